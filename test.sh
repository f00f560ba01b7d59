#!/usr/bin/env bash
# The project's test command (README, CI): creates .venv with the test tools when missing
# or changed, then lint, format check and the whole pytest suite. Extra arguments go to
# pytest (`./test.sh -k hostfile`). Exits non-zero on any failure and when no test ran.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")" || exit 1

# The coding agents install from npm while pip fills .venv: a fresh clone's setup took
# 135 s one after the other.
agents_log="$(mktemp)"
scripts/setup_agents.sh >"$agents_log" 2>&1 &
agents=$!
echo "==> Python environment (.venv with test tools)"
scripts/setup_venv.sh dev || exit 1
echo "==> Coding agents (Claude Code, Codex CLI, opencode from npm, pinned)"
wait "$agents"
agents_status=$?
cat "$agents_log"
rm -f "$agents_log"
((agents_status == 0)) || exit 1

# MLX's Linux CPU wheel ships a slow BLAS; Debian's OpenBLAS makes the model tests fast.
eval "$(.venv/bin/python -m launcher.command blas-env)"

echo "==> ruff check"
.venv/bin/ruff check . || { echo "error: ruff check found problems" >&2; exit 1; }
echo "==> ruff format --check"
.venv/bin/ruff format --check . ||
    { echo "error: files need formatting: .venv/bin/ruff format ." >&2; exit 1; }

echo "==> mypy (strict on config/, ipc/, gateway/)"
.venv/bin/mypy || { echo "error: the type checker found problems" >&2; exit 1; }

# Unit tests run on every core (pytest-xdist: 55 s instead of 92 s on 2 cores); anything
# with cluster tests runs in one process, since their ranks need the cores to themselves.
# With no arguments: the unit tests in parallel, then the cluster tests one at a time.
cores="$(getconf _NPROCESSORS_ONLN)"
echo "==> pytest"
SECONDS=0
if (($# == 0)); then
    .venv/bin/pytest -n "$cores" -m "not cluster"
    unit=$?
    .venv/bin/pytest -m cluster --durations=15
    cluster=$?
    status=$((unit > cluster ? unit : cluster))
else
    workers=()
    [[ " $* " == *"not cluster"* ]] && workers=(-n "$cores")
    .venv/bin/pytest ${workers[@]+"${workers[@]}"} "$@"
    status=$?
fi
echo "pytest finished in ${SECONDS} s with exit status $status"
if ((status == 5)); then
    echo "error: no tests ran (pytest exit 5): that is a failure here" >&2
    exit 1
fi
exit $status
