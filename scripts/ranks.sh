#!/bin/sh
# The ranks recorded in run/rank-*.pid of this project directory, on this host.
#   scripts/ranks.sh status [HOST [RANK]]   one line per rank (or only RANK):
#       "rank N: running on HOST (pid P)" or "DOWN ..."; exit 1 when one is down, 2 when none
#       is recorded
#   scripts/ranks.sh stop     TERM each rank, KILL after 5 s, remove the pid files; returns
#       once every rank it signalled has ended (exited: a zombie, or reaped)
# A pid counts as a rank only while it still runs server.py, so a reused pid is left alone.
# Run by launch.sh locally and over SSH on each worker.
cd "$(dirname "$0")/.." || exit 1
ours() { ps -p "$1" -o command= 2>/dev/null | grep -q 'server\.py'; }
# Not yet ended: still listed and not a zombie. An exiting process drops its command line
# (ours fails) before it has ended: it may still hold its ports and files then.
alive() {
    state=$(ps -p "$1" -o stat= 2>/dev/null)
    [ -n "$state" ] && [ "${state#Z}" = "$state" ]
}

status() {
    down=0
    found=""
    for f in run/rank-${2:-*}.pid; do
        [ -f "$f" ] || continue
        found=1
        rank=${f#run/rank-}
        rank=${rank%.pid}
        pid=$(cat "$f" 2>/dev/null)
        if [ -n "$pid" ] && ours "$pid"; then
            echo "rank $rank: running on $1 (pid $pid)"
        else
            echo "rank $rank: DOWN on $1 (pid $pid is gone)"
            down=1
        fi
    done
    [ -n "$found" ] || return 2
    return $down
}

stop() {
    pids=""
    for f in run/rank-*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f" 2>/dev/null)
        if [ -n "$pid" ] && ours "$pid"; then
            kill -TERM "$pid" 2>/dev/null && pids="$pids $pid"
        fi
    done
    alive=$pids
    for _ in $(seq 50); do # up to 5 s for a clean exit, then KILL
        alive=""
        for pid in $pids; do alive "$pid" && alive="$alive $pid"; done
        [ -z "$alive" ] && break
        sleep 0.1
    done
    for pid in $alive; do kill -KILL "$pid" 2>/dev/null; done
    for _ in $(seq 100); do # KILL ends a process at once, but its exit takes a moment
        left=""
        for pid in $alive; do alive "$pid" && left="$left $pid"; done
        alive=$left
        [ -z "$alive" ] && break
        sleep 0.1
    done
    rm -f run/rank-*.pid
    [ -n "$pids" ] && echo "ended rank pid(s):$pids on $(hostname)"
    return 0
}

case "${1:-}" in
status) status "${2:-$(hostname)}" "${3:-}" ;;
stop) stop ;;
*)
    echo "usage: scripts/ranks.sh status|stop" >&2
    exit 2
    ;;
esac
