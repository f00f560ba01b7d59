#!/bin/sh
# End the ranks recorded in run/rank-*.pid of this directory (on this host), by pid.
# A pid is only signalled while it still runs server.py, so a reused pid is left alone.
# Run by `./launch.sh stop` locally and over SSH on each worker; prints what it ended.
cd "$(dirname "$0")/.." || exit 1
ours() { ps -p "$1" -o command= 2>/dev/null | grep -q 'server\.py'; }
pids=""
for f in run/rank-*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f" 2>/dev/null)
    if [ -n "$pid" ] && ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null && pids="$pids $pid"
    fi
done
# up to 5 s for a clean exit, then KILL
for _ in $(seq 50); do
    alive=""
    for pid in $pids; do ours "$pid" && alive="$alive $pid"; done
    [ -z "$alive" ] && break
    sleep 0.1
done
for pid in $alive; do kill -KILL "$pid" 2>/dev/null; done
rm -f run/rank-*.pid
[ -n "$pids" ] && echo "ended rank pid(s):$pids on $(hostname)"
exit 0
