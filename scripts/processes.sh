#!/usr/bin/env bash
# launch.sh's processes: pid files, the process groups they lead, stopping a group, and
# starting a command as a new session's leader. Sourced by launch.sh (which sets ROOT, PY,
# the pid file paths and info()); bash 3.2 as on macOS.

pid_of() { [[ -s "$1" ]] && tr -dc '0-9' <"$1"; }

# A pid file is trusted only while its process still leads its own process group and
# runs what we started (so a reused pid is never signalled).
group_alive() { # group_alive PIDFILE PATTERN
    local pid
    pid="$(pid_of "$1")" || return 1
    [[ -n "$pid" ]] || return 1
    [[ "$(ps -p "$pid" -o pgid= 2>/dev/null | tr -d ' ')" == "$pid" ]] || return 1
    runs "$pid" "$2"
}

# A zombie (exited, not yet reaped by its parent) shows no command: it does not run.
runs() { ps -p "$1" -o command= 2>/dev/null | grep -q -- "$2"; } # runs PID PATTERN

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

supervisor_alive() { group_alive "$SUP_PID" launcher.supervisor; }
ranks_alive() { group_alive "$RANKS_PID" mlx.launch; }
api_alive() { group_alive "$API_PID" api.py; }
