"""The one builder of the mlx.launch command line and the ranks' environment.

launch.sh, the tests' clusters and the benchmarks all start ranks through this module, so
the BLAS preload, the threads-per-rank rule and mlx.launch's arguments live here only.

    python -m launcher.command ranks --port P    # the job's argv, NUL-separated (debugging)
    python -m launcher.command exec -- PROG ...  # scripts/rank.sh, on every host: preload
                                                 # this host's OpenBLAS, then exec Python
    python -m launcher.command blas-env          # test.sh: `export` lines for pytest

The `exec` path runs before every rank starts: it imports the standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.blas_shim import PREFIX as SGEMM_ROWS_PREFIX
from launcher.blas_shim import build as build_sgemm_rows
from launcher.blas_shim import calls_in_this_process, first_cpu

if TYPE_CHECKING:
    from config import Settings

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
# MLX's Linux CPU wheel ships a slow reference BLAS; Debian's OpenBLAS, preloaded, makes
# float32 matmul about 80x faster (apt-get install libopenblas0-pthread).
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
# What mlx.launch runs on every host of launch.sh's job (argv: the workers' directories as
# one comma list, then the program): workers cd to their REMOTE_DIR (field MLX_RANK), then
# scripts/rank.sh records the pid and execs the venv's Python through `exec` below.
RANK_SHELL = (
    'd=$1; shift; if [ "$MLX_RANK" != 0 ] && [ -n "$d" ]; then\n'
    'd=$(printf %s "$d" | cut -d, -f"$MLX_RANK"); case $d in "~"*) d=$HOME${d#"~"} ;; esac\n'
    'cd "$d" || exit 1; fi; exec ./scripts/rank.sh "$@"'
)


def blas_preload(
    environ: dict[str, str] | os._Environ[str] = os.environ, few_rows: bool = True
) -> dict[str, str]:
    """LD_PRELOAD with this host's OpenBLAS first, where it is installed, and the kernels
    for this CPU where the library does not know it (`blas_kernels`); before OpenBLAS, with
    `few_rows`, our sgemm for products of a few rows (native/sgemm_rows.c, built here on
    first use; launcher/blas_shim.py). The benchmarks' peer gets OpenBLAS alone."""
    if not OPENBLAS.exists():
        return {}
    env = blas_kernels(environ)
    current = [path for path in environ.get("LD_PRELOAD", "").split(":") if path]
    shim = build_sgemm_rows() if few_rows else None
    wanted = [str(shim)] if shim is not None else []
    wanted += [str(OPENBLAS)]
    if current[: len(wanted)] != wanted:
        kept = [path for path in current if path not in wanted and SGEMM_ROWS_PREFIX not in path]
        env["LD_PRELOAD"] = ":".join(wanted + kept)
    return env


# OpenBLAS picks its kernels by CPU model, and one older than the CPU falls back to its
# SSE3 "Prescott" kernels: Debian 12's 0.3.21 on a Xeon of family 6, model 207 (AVX-512)
# multiplied float32 at 33 GFLOPS a core, and at 167 with the "SkylakeX" kernels it has
# (OPENBLAS_CORETYPE); a batched prefill ran 2.6x faster. Kernels by the CPU's flags:
KERNELS = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Haswell", {"avx2", "fma"}),
    ("Sandybridge", {"avx"}),
)


def blas_in_use() -> str | None:
    """ "OpenBLAS 0.3.21, SkylakeX kernels; few-row products: native/sgemm_rows.c" where
    this process has OpenBLAS, else None."""
    try:
        library = ctypes.CDLL(str(OPENBLAS), mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    library.openblas_get_config.restype = ctypes.c_char_p
    library.openblas_get_corename.restype = ctypes.c_char_p
    version = library.openblas_get_config().decode().split()[:2]
    kernels = library.openblas_get_corename().decode()
    forced = " (OPENBLAS_CORETYPE)" if os.environ.get("OPENBLAS_CORETYPE") else ""
    built = calls_in_this_process() is not None
    rows = "native/sgemm_rows.c" if built else "OpenBLAS (native/sgemm_rows.c not built)"
    return f"{' '.join(version)}, {kernels} kernels{forced}; few-row products: {rows}"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The instruction-set flags of this machine's first CPU (none where Linux's cpuinfo is
    not there)."""
    return set(first_cpu(cpuinfo).get("flags", "").split())


def blas_kernels(
    environ: dict[str, str] | os._Environ[str] = os.environ, cpuinfo: Path = Path("/proc/cpuinfo")
) -> dict[str, str]:
    """OPENBLAS_CORETYPE naming the kernels this CPU runs, where this host's OpenBLAS fell
    back to Prescott's (unless OPENBLAS_CORETYPE is set already)."""
    flags = cpu_flags(cpuinfo)
    if "OPENBLAS_CORETYPE" in environ or not flags:
        return {}
    try:
        corename = ctypes.CDLL(str(OPENBLAS)).openblas_get_corename
    except (OSError, AttributeError):
        return {}
    corename.restype = ctypes.c_char_p
    if corename() != b"Prescott":
        return {}
    for kernels, needs in KERNELS:
        if needs <= flags:
            return {"OPENBLAS_CORETYPE": kernels}
    return {}


def blas_threads(
    local_ranks: int, environ: dict[str, str] | os._Environ[str] = os.environ
) -> dict[str, str]:
    """OpenBLAS threads for ranks that share this machine's cores (unless already set).

    OpenBLAS starts one busy-waiting thread per core in every rank, so local ranks fight
    over the cores: 2 ranks on 2 cores decoded 2.3x slower with its default threads.
    """
    if local_ranks <= 1 or "OPENBLAS_NUM_THREADS" in environ:
        return {}
    return {"OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // local_ranks))}


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
    from config import load_settings

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
        names = set(settings.as_env()) | {k for k in environ if k.startswith("OPENBLAS_")}
        job.rank_env = {k: environ[k] for k in sorted(names) if k in environ}
        # mlx.launch busy-loops on each remote rank's ssh stdin pipe too;
        # scripts/ssh-wrapper/ssh runs ssh with stdin closed, so that pipe closes.
        real_ssh = shutil.which("ssh")
        if real_ssh:
            env["MLX_RING_REAL_SSH"] = real_ssh
            env["PATH"] = f"{ROOT / 'scripts' / 'ssh-wrapper'}:{environ.get('PATH', '')}"
    else:
        job.cwd = ROOT  # --cwd is one path for every host: local mode only
    # scripts/rank.sh preloads the BLAS on each host; the thread count is ours to give
    env |= blas_threads(_local_entries(ROOT / "hosts.json"), environ)
    return ["env", *(f"{k}={v}" for k, v in env.items()), *job.argv()]


def exec_python(program: list[str]) -> None:
    """Become this venv's Python running `program`, with this host's BLAS preloaded."""
    python = sys.executable
    os.execve(python, [python, *program], {**os.environ, **blas_preload()})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["exec"]:  # the fast path every rank takes: no argparse, no settings
        exec_python(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    parser = argparse.ArgumentParser(prog="python -m launcher.command")
    sub = parser.add_subparsers(dest="command", required=True)
    ranks = sub.add_parser("ranks", help="launch.sh's job argv, NUL-separated")
    ranks.add_argument("--port", type=int, required=True)
    sub.add_parser("exec", help="preload this host's OpenBLAS, then exec Python with the rest")
    sub.add_parser("blas-env", help="export lines for a process that runs MLX itself")
    args = parser.parse_args(argv)
    if args.command == "blas-env":
        for key, value in blas_preload().items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    from config import SettingsError

    try:
        sys.stdout.write("".join(f"{arg}\0" for arg in launch_sh_argv(args.port)))
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
