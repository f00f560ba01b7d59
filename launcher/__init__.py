"""Operator-side tools launch.sh runs: hosts.json, worker checks over SSH, and the one
builder of the mlx.launch command and the ranks' environment. Never imported by a rank."""
