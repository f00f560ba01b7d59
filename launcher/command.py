"""The one builder of the mlx.launch command line and the ranks' environment.

launch.sh, the tests' clusters and the benchmarks all start ranks through this module, so
mlx.launch's arguments live here only; what each rank preloads is launcher/cpu_layer.py's.

    python -m launcher.command ranks --port P    # the job's argv, NUL-separated (debugging)
    python -m launcher.command exec -- PROG ...  # scripts/rank.sh, on every host: the CPU
                                                 # layer's preload, then exec Python
    python -m launcher.command blas-env          # test.sh: `export` lines for pytest

The `exec` path runs before every rank starts: it imports the standard library only (and
mlx.core, through cpu_layer's gate).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from acquisition.received import RECEIVED_ENV
from distributed.kept_split import KEPT_SPLIT_ENV
from launcher import cpu_layer

if TYPE_CHECKING:
    from config.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
# What mlx.launch runs on every host of launch.sh's job (argv: the workers' directories as
# one comma list, then the program): workers cd to their REMOTE_DIR (field MLX_RANK), then
# scripts/rank.sh records the pid and execs the venv's Python through `exec` below.
RANK_SHELL = (
    'd=$1; shift; if [ "$MLX_RANK" != 0 ] && [ -n "$d" ]; then\n'
    'd=$(printf %s "$d" | cut -d, -f"$MLX_RANK"); case $d in "~"*) d=$HOME${d#"~"} ;; esac\n'
    'cd "$d" || exit 1; fi; exec ./scripts/rank.sh "$@"'
)


@dataclass
class Job:
    """An mlx.launch job: its argv, and what to add to the caller's environment."""

    program: list[str]  # what each rank's python runs, e.g. ["server.py"]
    port: int
    ranks: int = 1  # local ranks on 127.0.0.1 (ignored with a hostfile)
    hostfile: Path | None = None
    backend: str = "ring"
    # the interpreter each host runs, then its own arguments before the program's
    python: list[str] = field(default_factory=lambda: [str(VENV_BIN / "python")])
    cwd: Path | None = None
    rank_env: dict[str, str] = field(default_factory=dict)  # --env: reaches remote ranks too

    def argv(self) -> list[str]:
        where = ["--hostfile", str(self.hostfile)] if self.hostfile else []
        if not self.hostfile:
            where = ["-n", str(self.ranks), "--hosts", "127.0.0.1"]
        argv = [str(VENV_BIN / "mlx.launch"), "--backend", self.backend, *where]
        argv += ["--starting-port", str(self.port)]
        if self.cwd is not None:
            argv += ["--cwd", str(self.cwd)]
        for key, value in self.rank_env.items():
            argv += ["--env", f"{key}={value}"]
        # mlx.launch takes one --python word; the rest follows `--`, before the program
        return [*argv, "--python", self.python[0], "--", *self.python[1:], *self.program]


def _local_entries(hostfile: Path) -> int:
    hosts = json.loads(hostfile.read_text())
    return sum(1 for host in hosts if host.get("ssh") == "127.0.0.1")


def launch_sh_argv(
    port: int,
    environ: dict[str, str] | os._Environ[str] = os.environ,
    settings: Settings | None = None,
) -> list[str]:
    """`env VAR=... mlx.launch ...` for launch.sh's job (the supervisor adds only its stdin):
    every host of hosts.json runs RANK_SHELL. `settings` defaults to the loaded ones; the
    supervisor passes those of a job without a left-out worker."""
    from config.settings import load_settings

    settings = settings or load_settings()
    job = Job(
        program=["server.py"],
        port=port,
        hostfile=ROOT / "hosts.json",
        backend=settings.distributed_backend,
        python=["/bin/sh", "-c", RANK_SHELL, "rank", ",".join(settings.remote_dirs)],
    )
    env: dict[str, str] = {}
    if settings.remote_mode:
        # Remote ranks read only their synced .env: settings overridden in this shell, and
        # OpenBLAS's own variables, travel with --env (an SSH session starts without them).
        # The model's key tells the workers' ranks what the first host sent them.
        names = set(settings.as_env()) | {k for k in environ if k.startswith("OPENBLAS_")}
        names |= {RECEIVED_ENV, KEPT_SPLIT_ENV}
        job.rank_env = {k: environ[k] for k in sorted(names) if k in environ}
        job.rank_env[cpu_layer.SWITCH] = settings.native_kernels
        # mlx.launch busy-loops on each remote rank's ssh stdin pipe too;
        # scripts/ssh-wrapper/ssh runs ssh with stdin closed, so that pipe closes.
        real_ssh = shutil.which("ssh")
        if real_ssh:
            env["MLX_RING_REAL_SSH"] = real_ssh
            env["PATH"] = f"{ROOT / 'scripts' / 'ssh-wrapper'}:{environ.get('PATH', '')}"
    else:
        job.cwd = ROOT  # --cwd is one path for every host: local mode only
    # scripts/rank.sh preloads the CPU layer on each host, which reads NATIVE_KERNELS from
    # its environment (not .env: the exec path loads no settings); the threads are ours
    env[cpu_layer.SWITCH] = settings.native_kernels
    env |= cpu_layer.threads(_local_entries(ROOT / "hosts.json"), environ)
    return ["env", *(f"{k}={v}" for k, v in env.items()), *job.argv()]


def exec_python(program: list[str]) -> int:
    """Become this venv's Python running `program`, with the CPU layer's preload where it
    applies (launcher/cpu_layer.py); 2 with the reason where NATIVE_KERNELS is bad."""
    try:
        env = {**os.environ, **cpu_layer.preload()}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    python = sys.executable
    os.execve(python, [python, *program], env)


def blas_env() -> int:
    """test.sh's `export` lines: NATIVE_KERNELS as the settings say (.env included), so
    the tests' clusters see it, and the CPU layer's preload for pytest itself."""
    from config.settings import SettingsError, load_settings

    try:
        switch = {cpu_layer.SWITCH: load_settings().native_kernels}
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    for key, value in (switch | cpu_layer.preload({**os.environ, **switch})).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["exec"]:  # the fast path every rank takes: no argparse, no settings
        return exec_python(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    parser = argparse.ArgumentParser(prog="python -m launcher.command")
    sub = parser.add_subparsers(dest="command", required=True)
    ranks = sub.add_parser("ranks", help="launch.sh's job argv, NUL-separated")
    ranks.add_argument("--port", type=int, required=True)
    sub.add_parser("exec", help="the CPU layer's preload, then exec Python with the rest")
    sub.add_parser("blas-env", help="export lines for a process that runs MLX itself")
    args = parser.parse_args(argv)
    if args.command == "blas-env":
        return blas_env()
    from config.settings import SettingsError

    try:
        sys.stdout.write("".join(f"{arg}\0" for arg in launch_sh_argv(args.port)))
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
