"""What the cluster was started with, so that `restart` restarts what runs.

`./launch.sh start` records the settings it was given in its environment (the variables
config/settings.py reads, and ENV_FILE) in run/started.env, and the settings in force (every
variable, as `python -m config` printed them) in run/in-force.env. Every other command that
works on the cluster (restart, stop, status, test, plan, detect, and `start --foreground`,
which the boot service and its restarts run) first takes the recorded environment settings
that its own environment does not set (`exports`). So `MODEL=/m NUM_DEVICES=2 ./launch.sh
start` then `./launch.sh restart` comes back with that model on 2 ranks, and
`NUM_DEVICES=3 ./launch.sh restart` changes that one setting and keeps the others; `changes`
names each setting that differs from the ones in force (old -> new) and `show` prints the
settings in force for `./launch.sh status`. A plain `start` begins afresh from .env and its
own environment. The supervisor's own restarts (a rank killed, a degraded start) reuse the
environment it was started with.

    python -m launcher.settings_record record             # start: write both files
    python -m launcher.settings_record exports            # shell lines: export KEY=value
    python -m launcher.settings_record changes            # restart: one line per change
    python -m launcher.settings_record show               # status: the settings in force
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from config.settings import Settings
from launcher.paths import Paths

SECRET = {"API_KEY"}  # shown as (set) or (empty), never as its value


def setting_names() -> set[str]:
    """Every environment variable the settings read (upper case), ENV_FILE included."""
    names = {"ENV_FILE"}
    for name, field in Settings.model_fields.items():
        names.add(name.upper())
        choices = getattr(field.validation_alias, "choices", None) or []
        names.update(str(choice).upper() for choice in choices)
    return names


def from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings `environ` gives (pydantic-settings reads them in any case)."""
    names = setting_names()
    return {key: value for key, value in environ.items() if key.upper() in names}


def read_env(path: Path) -> dict[str, str]:
    """KEY=value lines (as `python -m config` prints them); {} when the file is missing."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key: value for key, value in pairs}


def write_env(path: Path, values: Mapping[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
    path.chmod(0o600)  # API_KEY may be among them


def record(paths: Paths, environ: Mapping[str, str], settings_file: Path) -> int:
    """Keep the environment's settings and the settings in force (`settings_file`)."""
    given = from_environment(environ)
    bad = [key for key, value in given.items() if "\n" in value]
    if bad:
        print(f"error: {bad[0]} holds a line break; settings are one line each", file=sys.stderr)
        return 2
    write_env(paths.run / "started.env", given)
    write_env(paths.run / "in-force.env", read_env(settings_file))
    return 0


def exports(paths: Paths, environ: Mapping[str, str]) -> list[str]:
    """`export KEY=value` for each recorded setting that `environ` does not set."""
    mine = {key.upper() for key in from_environment(environ)}
    recorded = read_env(paths.run / "started.env")
    return [
        f"export {key}={shlex.quote(value)}"
        for key, value in recorded.items()
        if key.upper() not in mine and key.isidentifier()
    ]


def _shown(key: str, value: str) -> str:
    if key in SECRET:
        return "(set)" if value else "(empty)"
    return value if value else "(empty)"


def changes(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """One line per setting whose value differs: `NAME: old -> new`."""
    return [
        f"{key}: {_shown(key, old.get(key, ''))} -> {_shown(key, new[key])}"
        for key in new
        if key in old and old[key] != new[key]
    ]


def defaults() -> dict[str, str]:
    """Every setting's default, as `python -m config` prints it."""
    return Settings.model_construct().as_env()


def show(paths: Paths) -> list[str]:
    """The settings in force (those not at their default), and which came from the
    environment of the start."""
    in_force = read_env(paths.run / "in-force.env")
    if not in_force:
        return ["settings: none recorded (started before this version, or never started)"]
    base = defaults()
    changed = [f"{key}={_shown(key, v)}" for key, v in in_force.items() if base.get(key) != v]
    given = sorted(read_env(paths.run / "started.env"))
    lines = [f"settings in force (not the defaults): {' '.join(changed) or 'all defaults'}"]
    lines.append(
        "  given in the environment at start (restart keeps them): "
        + (", ".join(given) if given else "none")
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.settings_record")
    parser.add_argument("command", choices=["record", "exports", "changes", "show"])
    parser.add_argument("--settings", type=Path, default=None, help="default: run/settings.env")
    args = parser.parse_args(argv)
    paths = Paths()
    settings_file = args.settings or paths.run / "settings.env"
    if args.command == "record":
        return record(paths, os.environ, settings_file)
    if args.command == "exports":
        lines = exports(paths, os.environ)
    elif args.command == "changes":
        lines = changes(read_env(paths.run / "in-force.env"), read_env(settings_file))
    else:
        lines = show(paths)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
