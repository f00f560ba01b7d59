#!/usr/bin/env bash
# The project's test command (README, CI): creates .venv with the test tools when missing
# or changed, then lint, format check and the whole pytest suite. Extra arguments go to
# pytest (`./test.sh -k hostfile`). Exits non-zero on any failure and when no test ran.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")" || exit 1

echo "==> Python environment (.venv with test tools)"
scripts/setup_venv.sh dev || exit 1
echo "==> Coding agents (Claude Code, Codex CLI, opencode from npm, pinned)"
scripts/setup_agents.sh || exit 1

# MLX's Linux CPU wheel ships a slow BLAS; Debian's OpenBLAS makes the model tests fast.
eval "$(.venv/bin/python -m launcher.command blas-env)"

echo "==> ruff check"
.venv/bin/ruff check . || { echo "error: ruff check found problems" >&2; exit 1; }
echo "==> ruff format --check"
.venv/bin/ruff format --check . ||
    { echo "error: files need formatting: .venv/bin/ruff format ." >&2; exit 1; }

echo "==> mypy (strict on config/, ipc/, gateway/)"
.venv/bin/mypy || { echo "error: the type checker found problems" >&2; exit 1; }

# The unit tests alone (-m "not cluster") run on every core: 55 s instead of 92 s on 2 cores.
# Anything with cluster tests runs in one process: their ranks need the cores to themselves.
workers=()
[[ " $* " == *"not cluster"* ]] && workers=(-n "$(getconf _NPROCESSORS_ONLN)")

echo "==> pytest"
SECONDS=0
.venv/bin/pytest ${workers[@]+"${workers[@]}"} "$@"
status=$?
echo "pytest finished in ${SECONDS} s with exit status $status"
if ((status == 5)); then
    echo "error: no tests ran (pytest exit 5): that is a failure here" >&2
    exit 1
fi
exit $status
