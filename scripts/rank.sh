#!/bin/sh
# The "python" that mlx.launch runs on every host, in the project directory: records this
# rank's pid (stop uses it; mlx.launch's own pid file is hidden in a temp file), then
# becomes the venv's Python through launcher/command.py, which preloads this host's
# OpenBLAS. Each step is `exec`, so the recorded pid is the rank itself.
mkdir -p run
echo $$ >"run/rank-${MLX_RANK:-0}.pid"
exec "$(pwd)/.venv/bin/python" -m launcher.command exec "$@"
