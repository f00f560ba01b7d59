#!/usr/bin/env bash
# launch.sh's settings: .env and the environment validated into run/settings.env, read back
# with cfg, and what the last start was given (launcher/settings_record.py), so that every
# command but a plain start works on the cluster as it was started. Sourced by launch.sh
# (which sets PY, RUN, SETTINGS, info() and abort_start()); bash 3.2 as on macOS.

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

# The settings the last start was given in its environment (run/started.env) that this
# command's environment does not set: every command but a plain `start` works on the
# cluster as it was started (launcher/settings_record.py)
recorded_settings() {
    local lines
    [[ -x "$PY" ]] || return 0
    lines="$("$PY" -m launcher.settings_record exports)" || return 0
    eval "$lines"
}

record_settings() { # at start: what this start was given and the settings in force
    "$PY" -m launcher.settings_record record || abort_start "could not record the settings"
}

show_setting_changes() { # restart: a line per setting that differs from those in force
    local changed
    changed="$("$PY" -m launcher.settings_record changes)"
    if [[ -n "$changed" ]]; then
        printf '%s\n' "$changed" | sed 's/^/    /'
    else
        info "no setting changes"
    fi
}
