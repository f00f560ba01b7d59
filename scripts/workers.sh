# Remote mode parts of launch.sh (sourced by it): the worker hosts over SSH.
# Uses launch.sh's helpers: cfg, workers, ssh_batch, step, info, warn, abort_start.

# Environment overrides (NUM_DEVICES=3 ./launch.sh start) must reach the remote ranks
# too, which only read their synced .env: pass each overridden setting with --env.
env_overrides() {
    local key
    for key in $(cut -d= -f1 "$SETTINGS"); do
        [[ -n "${!key+x}" ]] && printf -- '--env\n%s=%s\n' "$key" "${!key}"
    done
}

sync_workers() {
    local rank dest dir
    dir="$(cfg REMOTE_DIR)"
    [[ "$dir" =~ ^[~A-Za-z0-9_./-]+$ ]] ||
        abort_start "REMOTE_DIR='$dir' must be a plain path (letters, digits, ~ _ . / -)"
    step "Sync code, config and .env to the workers ($dir)"
    while read -r rank dest; do
        info "rank $rank: $dest"
        ssh_batch "$dest" "mkdir -p $dir" >"$RUN/sync.log" 2>&1 ||
            abort_start "cannot reach $dest over SSH (run ./launch.sh detect)" "$RUN/sync.log"
        rsync -az -e "ssh -o BatchMode=yes" --exclude .venv --exclude run --exclude .git \
            --exclude '*.log' --exclude __pycache__ --exclude .pytest_cache \
            --exclude .ruff_cache --exclude .hypothesis ./ "$dest:$dir/" >>"$RUN/sync.log" 2>&1 ||
            abort_start "rsync to $dest:$dir failed" "$RUN/sync.log"
        ssh_batch "$dest" "cd $dir && scripts/setup_venv.sh runtime" 2>&1 | sed 's/^/      /'
        [[ "${PIPESTATUS[0]}" == 0 ]] || abort_start "could not prepare the venv on $dest"
        ssh_batch "$dest" "cd $dir && .venv/bin/python -m engine.model_source" \
            >"$RUN/model-$rank.log" 2>&1 ||
            abort_start "rank $rank ($dest) could not resolve MODEL" "$RUN/model-$rank.log"
    done < <(workers)
}

stop_workers() { # stop_workers [quiet]: end the ranks each worker recorded, by pid
    local rank dest dir
    dir="$(cfg REMOTE_DIR)"
    while read -r rank dest; do
        ssh_batch "$dest" "$dir/scripts/ranks.sh stop" 2>/dev/null | sed 's/^/    /' ||
            [[ "${1:-}" == quiet ]] || warn "could not reach $dest to stop rank $rank"
    done < <(workers 2>/dev/null)
}

status_workers() { # each worker's ranks; returns 1 when any is down or unreachable
    local rank dest dir ok=0 rc
    dir="$(cfg REMOTE_DIR)"
    while read -r rank dest; do
        ssh_batch "$dest" "$dir/scripts/ranks.sh status $dest $rank" 2>/dev/null
        rc=$?
        case $rc in
        0) ;;
        1) ok=1 ;;
        2) ok=1 && echo "rank $rank: DOWN on $dest (no rank recorded in $dir/run)" ;;
        *) ok=1 && echo "rank $rank: DOWN on $dest (unreachable over SSH, exit $rc)" ;;
        esac
    done < <(workers)
    return $ok
}
