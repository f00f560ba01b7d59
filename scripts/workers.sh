# Remote mode parts of launch.sh (sourced by it): the worker hosts over SSH. Workers never
# resolve MODEL: the supervisor sends each its part from this host before every start
# (launcher/transfer.py).
# Uses launch.sh's helpers: cfg, workers, ssh_batch, step, info, warn, abort_start.
# (The --env overrides that reach the remote ranks are built by launcher/command.py.)
# `workers` prints "rank ssh-destination dir" per worker: REMOTE_DIR is one path for
# every worker or one per worker (validated by config/settings.py: plain path characters,
# so the paths go unquoted into the remote shell, where `~` expands).

sync_workers() {
    local rank dest dir
    step "Sync code, config and .env to the workers"
    # every worker first, so that one that cannot be reached stops start at once
    while read -r rank dest dir; do
        ssh_batch "$dest" "mkdir -p $dir" >"$RUN/sync.log" 2>&1 ||
            abort_start "cannot reach rank $rank's host $dest over SSH: $(tail -n 1 \
                "$RUN/sync.log") (check it with ./launch.sh detect)"
    done < <(workers)
    while read -r rank dest dir; do
        info "rank $rank: $dest:$dir"
        rsync -az -e "ssh -o BatchMode=yes -o ConnectTimeout=5" --exclude .venv --exclude run \
            --exclude .git --exclude '*.log' --exclude __pycache__ --exclude .pytest_cache \
            --exclude .ruff_cache --exclude .hypothesis ./ "$dest:$dir/" >>"$RUN/sync.log" 2>&1 ||
            abort_start "rsync to $dest:$dir failed" "$RUN/sync.log"
        worker_venv "$rank" "$dest" "$dir"
    done < <(workers)
}

worker_venv() { # rank dest dir: the pinned venv there, from the index or from our wheels
    local rank="$1" dest="$2" dir="$3" here there why
    ssh_batch "$dest" "cd $dir && scripts/setup_venv.sh status" 2>&1 | sed 's/^/      /'
    [[ "${PIPESTATUS[0]}" == 0 ]] && return 0
    if why="$(ssh_batch "$dest" "cd $dir && scripts/setup_venv.sh reach-index" 2>&1)"; then
        ssh_batch "$dest" "cd $dir && scripts/setup_venv.sh runtime" 2>&1 | sed 's/^/      /'
        [[ "${PIPESTATUS[0]}" == 0 ]] || abort_start "could not prepare the venv on $dest"
        return 0
    fi
    # No index there: the same pins, as wheels this host downloads (once, into run/wheels),
    # sent over SSH and installed with --no-index. They fit only the same Python and system.
    info "rank $rank ($dest) cannot reach the package index ($(printf '%s' "$why" | tail -n 1));" \
        "it installs the wheels this host downloads"
    here="$("$ROOT/scripts/setup_venv.sh" platform)"
    there="$(ssh_batch "$dest" "cd $dir && scripts/setup_venv.sh platform" 2>&1 | tail -n 1)"
    [[ "$here" == "$there" ]] || abort_start "rank $rank ($dest) cannot reach the package index" \
        "and runs $there, this host $here: this host's wheels would not install there; give" \
        "it access to the index, or install $dir/.venv there by hand"
    "$ROOT/scripts/setup_venv.sh" wheels "$RUN/wheels" >>"$RUN/sync.log" 2>&1 ||
        abort_start "could not download the wheels for $dest (pip download)" "$RUN/sync.log"
    rsync -a -e "ssh -o BatchMode=yes -o ConnectTimeout=5" "$RUN/wheels/" \
        "$dest:$dir/run/wheels/" >>"$RUN/sync.log" 2>&1 ||
        abort_start "could not send the wheels to $dest:$dir/run/wheels" "$RUN/sync.log"
    ssh_batch "$dest" "cd $dir && WHEELHOUSE=run/wheels scripts/setup_venv.sh runtime" 2>&1 |
        sed 's/^/      /'
    [[ "${PIPESTATUS[0]}" == 0 ]] || abort_start "could not install the wheels on $dest"
}

check_workers() { # after sync: same Python, mlx and mlx-lm as here, enough memory
    step "Check the workers (python -m launcher.detect)"
    "$PY" -m launcher.detect >"$RUN/detect.txt" 2>&1
    local rc=$?
    sed 's/^/    /' "$RUN/detect.txt"
    ((rc == 0)) && return 0
    abort_start "worker check failed: $(grep -m 1 -e '^problem: ' -e 'unreachable' -e '^error: ' \
        "$RUN/detect.txt" | sed 's/^problem: //; s/^error: //')"
}

stop_workers() { # stop_workers [quiet]: end the ranks each worker recorded, by pid
    local rank dest dir
    while read -r rank dest dir; do
        ssh_batch "$dest" "$dir/scripts/ranks.sh stop" 2>/dev/null | sed 's/^/    /' ||
            [[ "${1:-}" == quiet ]] || warn "could not reach $dest to stop rank $rank"
    done < <(workers 2>/dev/null)
}

status_workers() { # the running job's workers (DEGRADED_MODE=auto may leave some out)
    local rank dest dir ok=0 rc
    while read -r rank dest dir; do
        ssh_batch "$dest" "$dir/scripts/ranks.sh status $dest $rank" 2>/dev/null
        rc=$?
        case $rc in
        0) ;;
        1) ok=1 ;;
        2) ok=1 && echo "rank $rank: DOWN on $dest (no rank recorded in $dir/run)" ;;
        *) ok=1 && echo "rank $rank: DOWN on $dest (unreachable over SSH, exit $rc)" ;;
        esac
    done < <(workers --current)
    return $ok
}
