"""`./launch.sh detect`: check every worker host over SSH before a remote start.

For each worker: reachable with SSH in BatchMode (no password prompt), the same Python
(major.minor), mlx and mlx-lm versions as this machine when its venv exists, and its
free memory. Prints one line per host and one line per problem with what to fix; exits 1
when any host is unusable.

    python -m launcher.detect [--timeout S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from pydantic import BaseModel

from config.settings import Settings, run_with_settings
from launcher.hostfile import HostfileError, worker_destinations

# Runs on each host with its own interpreter (sent on stdin, so it needs nothing installed).
FACTS_SCRIPT = r"""
import json, os, platform, socket, subprocess, sys
from importlib import metadata

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

def free_bytes():
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info.get("MemFree")), info["MemTotal"]
    except OSError:
        pass
    try:  # macOS
        total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True,
                                   text=True).stdout)
        out = subprocess.run(["vm_stat"], capture_output=True, text=True).stdout
        page = int(out.split("page size of")[1].split()[0])
        pages = {k.strip(): int(v.strip(" .")) for k, v in
                 (line.split(":") for line in out.splitlines()[1:] if ":" in line)}
        free = sum(pages.get(k, 0) for k in ("Pages free", "Pages inactive", "Pages purgeable"))
        return free * page, total
    except Exception:
        return None, None

def rank_memory():  # what a rank there will plan with (distributed.hosts.local_memory_bytes)
    try:
        import mlx.core as mx
        info = mx.device_info()
        return next((int(info[k]) for k in ("max_recommended_working_set_size", "memory_size")
                     if info.get(k)), None)
    except Exception:
        return None

def chip():  # the Apple chip, for the step-time model (distributed/chips.py)
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                             text=True, timeout=5).stdout.strip()
        return out.removeprefix("Apple ").strip() or None
    except Exception:
        return None

free, total = free_bytes()
print(json.dumps({"python": platform.python_version(), "system": platform.system(),
                  "machine": platform.machine(), "mlx": version("mlx"),
                  "mlx_lm": version("mlx-lm"), "free_bytes": free, "total_bytes": total,
                  "venv": sys.prefix != sys.base_prefix, "cores": os.cpu_count(),
                  "rank_memory_bytes": rank_memory(), "hostname": socket.gethostname()[:64],
                  "chip": chip()}))
"""

SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
MIN_FREE_BYTES = 1 << 30


class HostFacts(BaseModel):
    python: str
    system: str
    machine: str
    mlx: str | None
    mlx_lm: str | None
    free_bytes: int | None
    total_bytes: int | None
    venv: bool
    cores: int | None = None
    rank_memory_bytes: int | None = None  # mlx's view (Metal working set), when mlx is there
    hostname: str = ""  # as its rank names itself (distributed/hosts.py)
    chip: str | None = None  # an Apple chip's name ("M2 Ultra"), for the plan's speeds


def local_facts() -> HostFacts:
    """The facts of this machine, from the interpreter running this module (the venv)."""
    out = subprocess.run(
        [sys.executable, "-c", FACTS_SCRIPT], capture_output=True, text=True, check=True
    )
    return HostFacts.model_validate_json(out.stdout)


def remote_facts(dest: str, remote_dir: str, timeout: float) -> HostFacts:
    """The facts of `dest`, from REMOTE_DIR/.venv's Python when it exists, else python3."""
    python = f'p={remote_dir}/.venv/bin/python; [ -x "$p" ] || p=python3; exec "$p" -'
    cmd = ["ssh", *SSH_OPTIONS, "-o", f"ConnectTimeout={int(timeout)}", dest, python]
    try:
        out = subprocess.run(
            cmd, input=FACTS_SCRIPT, capture_output=True, text=True, timeout=timeout + 10
        )
    except subprocess.TimeoutExpired:
        raise ConnectionError(f"no answer within {timeout + 10:.0f} s") from None
    except FileNotFoundError:
        raise ConnectionError("ssh is not installed on this machine") from None
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        raise ConnectionError(lines[-1] if lines else f"ssh exited with {out.returncode}")
    return HostFacts.model_validate_json(out.stdout.strip().splitlines()[-1])


def compare(
    host: str, here: HostFacts, there: HostFacts, remote_dir: str = "REMOTE_DIR"
) -> list[str]:
    """One line per mismatch between this machine and a worker, each saying what to fix."""
    problems = []
    if here.python.rsplit(".", 1)[0] != there.python.rsplit(".", 1)[0]:
        problems.append(
            f"{host}: Python {there.python}, here {here.python}: install Python "
            f"{here.python.rsplit('.', 1)[0]} there (pinned wheels need the same version)"
        )
    if there.venv:  # before the first start the venv does not exist; start creates it
        for name, mine, theirs in (
            ("mlx", here.mlx, there.mlx),
            ("mlx-lm", here.mlx_lm, there.mlx_lm),
        ):
            if mine != theirs:
                problems.append(
                    f"{host}: {name} {theirs or 'missing'}, here {mine}: delete "
                    f"{remote_dir}/.venv there, then `./launch.sh start` installs the "
                    "pinned requirements.txt"
                )
    if there.free_bytes is not None and there.free_bytes < MIN_FREE_BYTES:
        problems.append(
            f"{host}: only {there.free_bytes / 2**30:.1f} GiB free memory: close other "
            "programs or drop this host"
        )
    return problems


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f} GiB"


def detect(settings: Settings, timeout: float) -> int:
    """Check every worker; print a line per host and per problem. Returns the exit code."""
    here = local_facts()
    print(
        f"this host: Python {here.python}, mlx {here.mlx}, mlx-lm {here.mlx_lm}, "
        f"free {_gib(here.free_bytes)} of {_gib(here.total_bytes)}"
    )
    workers = worker_destinations(settings)
    if not workers:
        print(f"local mode: WORKER_HOSTS is empty, {settings.num_devices} ranks on 127.0.0.1")
        return 0
    failed = False
    for (address, dest), remote_dir in zip(workers, settings.remote_dirs, strict=True):
        try:
            there = remote_facts(dest, remote_dir, timeout)
        except (ConnectionError, ValueError) as exc:
            failed = True
            print(
                f"{dest}: unreachable over SSH in BatchMode ({exc}); check that `ssh {dest}` "
                "works without a password (ssh-copy-id) and that Remote Login is on"
            )
            continue
        venv = "venv" if there.venv else "no venv yet, start creates it"
        print(
            f"{dest} ({address}): {there.system} {there.machine}, Python {there.python}, "
            f"mlx {there.mlx or '-'}, mlx-lm {there.mlx_lm or '-'} ({venv}), "
            f"free {_gib(there.free_bytes)} of {_gib(there.total_bytes)}"
        )
        for problem in compare(dest, here, there, remote_dir):
            failed = True
            print(f"problem: {problem}")
    print("detect: FAILED, fix the problems above" if failed else "detect: all hosts ready")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.detect")
    parser.add_argument("--timeout", type=float, default=5.0, help="SSH connect timeout (s)")
    args = parser.parse_args(argv)
    return run_with_settings(lambda settings: detect(settings, args.timeout), HostfileError)


if __name__ == "__main__":
    raise SystemExit(main())
