"""`./launch.sh service install|uninstall`: start the cluster at boot under the system's
service manager, with the supervisor in the foreground (`launch.sh start --foreground`)
and `launch.sh stop` to end it.

- macOS: a launchd agent, ~/Library/LaunchAgents/com.mlx-ring.cluster.plist, loaded into
  the user's GUI domain: it starts when the user logs in (with automatic login, at boot),
  again after a failure (KeepAlive on an unsuccessful exit), and launchctl's SIGTERM stops
  the supervisor, which ends the ranks and api.py.
- Linux: a systemd unit, /etc/systemd/system/mlx-ring.service run as the project's owner
  when installed as root (starts at boot), else a user unit in ~/.config/systemd/user
  (starts at boot once `loginctl enable-linger` is on). Restart=on-failure; ExecStop runs
  `launch.sh stop`; systemd then ends anything left in the unit's cgroup.

Without a running service manager (a container) the file is written and checked
(`systemd-analyze verify` where installed) but not enabled, and the output says so.

    python -m launcher.service install|uninstall [--dir DIR] [--print]
"""

from __future__ import annotations

import argparse
import os
import platform
import plistlib
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from launcher.command import ROOT

UNIT = "mlx-ring.service"
LABEL = "com.mlx-ring.cluster"


def start_command(root: Path) -> list[str]:
    return [str(root / "launch.sh"), "start", "--foreground"]


def stop_command(root: Path) -> list[str]:
    return [str(root / "launch.sh"), "stop"]


def _systemd_words(words: list[str]) -> str:
    """A command line for ExecStart=/ExecStop= (systemd's quoting: double quotes)."""
    return " ".join('"' + w.replace("\\", "\\\\").replace('"', '\\"') + '"' for w in words)


def systemd_unit(root: Path, user: str | None, path_env: str) -> str:
    """The unit text; `user` for a system unit (None: a user unit)."""
    run_as = f"User={user}\n" if user else ""
    target = "multi-user.target" if user else "default.target"
    return (
        "[Unit]\n"
        f"Description=MLX ring inference cluster ({root})\n"
        "Documentation=file://" + str(root / "README.md") + "\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"{run_as}"
        f"WorkingDirectory={root}\n"
        f'Environment="PATH={path_env}"\n'
        f"ExecStart={_systemd_words(start_command(root))}\n"
        f"ExecStop={_systemd_words(stop_command(root))}\n"
        "Restart=on-failure\n"
        "RestartSec=10\n"
        # the first start prepares the venv and may import a model: no start timeout
        "TimeoutStartSec=infinity\n"
        "TimeoutStopSec=120\n"
        "\n"
        "[Install]\n"
        f"WantedBy={target}\n"
    )


def launchd_plist(root: Path, path_env: str) -> bytes:
    return plistlib.dumps(
        {
            "Label": LABEL,
            "ProgramArguments": start_command(root),
            "WorkingDirectory": str(root),
            "EnvironmentVariables": {"PATH": path_env},
            "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False},  # again after a failure, not after stop
            "ThrottleInterval": 10,
            "ExitTimeOut": 120,  # SIGTERM, then this long before SIGKILL
            "StandardOutPath": str(root / "service.log"),
            "StandardErrorPath": str(root / "service.log"),
        }
    )


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return done.returncode, (done.stdout + done.stderr).strip()


def _say(line: str) -> None:
    print(f"    {line}")


# ---- Linux ---------------------------------------------------------------------------------


def _unit_path(directory: Path | None) -> tuple[Path, bool]:
    """Where the unit goes, and whether it is a system unit."""
    system = os.geteuid() == 0
    if directory is not None:
        return directory / UNIT, system
    if system:
        return Path("/etc/systemd/system") / UNIT, True
    return Path.home() / ".config" / "systemd" / "user" / UNIT, False


def _systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


def install_systemd(root: Path, directory: Path | None) -> int:
    path, system = _unit_path(directory)
    owner = pwd.getpwuid(root.stat().st_uid).pw_name if system else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(systemd_unit(root, owner, os.environ.get("PATH", "/usr/bin:/bin")))
    _say(f"wrote {path} ({'system unit, runs as ' + str(owner) if system else 'user unit'})")
    if shutil.which("systemd-analyze"):
        code, out = _run(["systemd-analyze", "verify", str(path)])
        _say("systemd-analyze verify: " + ("no problems" if code == 0 else out))
        if code != 0:
            return 1
    if directory is not None:
        return 0
    if not _systemd_running():
        _say("systemd is not running here (no /run/systemd/system): the unit is written but")
        _say(f"not enabled; on a systemd host: systemctl enable --now {UNIT}")
        return 0
    scope = [] if system else ["--user"]
    for argv in (["daemon-reload"], ["enable", "--now", UNIT]):
        code, out = _run(["systemctl", *scope, *argv])
        if code != 0:
            print(f"error: systemctl {' '.join(argv)} failed: {out}", file=sys.stderr)
            return 1
    _say(f"enabled and started {UNIT}: the cluster starts at boot")
    if not system:
        name = pwd.getpwuid(os.getuid()).pw_name
        _say(f"a user unit starts at boot only with: loginctl enable-linger {name}")
    _say(f"status: systemctl {' '.join(scope + ['status', UNIT])}; logs: supervisor.log")
    return 0


def uninstall_systemd(directory: Path | None) -> int:
    path, system = _unit_path(directory)
    if directory is None and _systemd_running():
        scope = [] if system else ["--user"]
        _run(["systemctl", *scope, "disable", "--now", UNIT])
        _say(f"disabled and stopped {UNIT}")
    if path.exists():
        path.unlink()
        _say(f"removed {path}")
        if directory is None and _systemd_running():
            _run(["systemctl", *([] if system else ["--user"]), "daemon-reload"])
    else:
        _say(f"no unit at {path}: nothing to remove")
    return 0


# ---- macOS ---------------------------------------------------------------------------------


def _plist_path(directory: Path | None) -> Path:
    return (directory or Path.home() / "Library" / "LaunchAgents") / f"{LABEL}.plist"


def install_launchd(root: Path, directory: Path | None) -> int:
    path = _plist_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(launchd_plist(root, os.environ.get("PATH", "/usr/bin:/bin")))
    _say(f"wrote {path}")
    if directory is not None or not shutil.which("launchctl"):
        return 0
    domain = f"gui/{os.getuid()}"
    _run(["launchctl", "bootout", f"{domain}/{LABEL}"])  # an older copy, if loaded
    code, out = _run(["launchctl", "bootstrap", domain, str(path)])
    if code != 0:
        print(f"error: launchctl bootstrap {domain} failed: {out}", file=sys.stderr)
        return 1
    _say(f"loaded {LABEL}: the cluster starts now and at each login; logs: service.log")
    return 0


def uninstall_launchd(directory: Path | None) -> int:
    path = _plist_path(directory)
    if directory is None and shutil.which("launchctl"):
        code, _ = _run(["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"])
        if code == 0:
            _say(f"unloaded {LABEL} (its supervisor stopped the cluster)")
    if path.exists():
        path.unlink()
        _say(f"removed {path}")
    else:
        _say(f"no agent at {path}: nothing to remove")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./launch.sh service")
    parser.add_argument("action", choices=["install", "uninstall"])
    parser.add_argument("--dir", type=Path, default=None, help="write here; enable nothing")
    parser.add_argument("--print", action="store_true", help="print the file, change nothing")
    args = parser.parse_args(argv)
    macos = platform.system() == "Darwin"
    path_env = os.environ.get("PATH", "/usr/bin:/bin")
    if args.print:
        text = (
            launchd_plist(ROOT, path_env).decode()
            if macos
            else systemd_unit(ROOT, pwd.getpwuid(ROOT.stat().st_uid).pw_name, path_env)
        )
        print(text, end="")
        return 0
    kind = "launchd agent" if macos else "systemd unit"
    print(f"==> Service ({kind}): {args.action}; start: {shlex.join(start_command(ROOT))}")
    if args.action == "install":
        return install_launchd(ROOT, args.dir) if macos else install_systemd(ROOT, args.dir)
    return uninstall_launchd(args.dir) if macos else uninstall_systemd(args.dir)


if __name__ == "__main__":
    sys.exit(main())
