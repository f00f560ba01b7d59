"""Build native/sgemm_rows.c, the few-row sgemm that goes in front of OpenBLAS.

Standard library only: every rank's exec path (launcher/command.py) asks for the library
before it becomes Python with MLX, on its own host. The library is built once per source
version and kind of CPU into .venv/lib (a few hundred milliseconds with cc), atomically,
so ranks that start together on one host do not trip over each other's build. `-march=native`
code can use instructions another CPU lacks, so the name carries the CPU's model and
flags: hosts that share a checkout (NFS) keep one build each. A new build removes this
CPU's builds of older sources (a rank still running one keeps its mapping). Where no C
compiler is found or the build fails, the ranks run without it (the rank's "matrix
products" log line says which) and products of a few rows go through OpenBLAS's sgemm,
about half as fast.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "native" / "sgemm_rows.c"
BUILD_DIR = ROOT / ".venv" / "lib"
PREFIX = "sgemm_rows-"  # of every build's file name: sgemm_rows-<cpu>-<source>.so
COUNTER = "mlx_ring_sgemm_rows_calls"  # exported by the library: products it took over


def _digest(data: bytes, length: int) -> str:
    return hashlib.sha256(data).hexdigest()[:length]


def first_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The fields of the first CPU in Linux's cpuinfo ("flags", "model name", ...); none
    where it is not there."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first CPU's block ends at a blank line
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_key() -> str:
    """What `-march=native` compiles for, hashed: this CPU's model name and feature flags
    (the machine's architecture where /proc/cpuinfo is not there)."""
    cpu = first_cpu()
    facts = "\n".join(cpu[name] for name in ("model name", "flags") if name in cpu)
    return _digest((facts or platform.machine()).encode(), 8)


def library_path(source: Path = SOURCE, build_dir: Path = BUILD_DIR) -> Path:
    """Where this version of the source is built for this CPU (both hashes in the name)."""
    return build_dir / f"{PREFIX}{cpu_key()}-{_digest(source.read_bytes(), 12)}.so"


def _remove_older_builds(target: Path) -> None:
    """This CPU's builds of other sources, and builds named by the source alone (before
    the CPU was in the name); other CPUs' builds stay."""
    cpu = target.name.split("-")[1]
    for old in target.parent.glob(f"{PREFIX}*.so"):
        parts = old.name.split("-")
        if old != target and (len(parts) == 2 or parts[1] == cpu):
            old.unlink(missing_ok=True)


def build(source: Path = SOURCE, build_dir: Path = BUILD_DIR) -> Path | None:
    """The built library, building it if needed; None where it cannot be built here."""
    if not source.exists():
        return None
    target = library_path(source, build_dir)
    if target.exists():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or not build_dir.is_dir():
        return None
    fd, partial = tempfile.mkstemp(prefix=f".{PREFIX}", suffix=".so", dir=build_dir)
    os.close(fd)
    command = [
        compiler,
        "-O3",
        "-march=native",
        "-shared",
        "-fPIC",
        "-o",
        partial,
        str(source),
        "-ldl",
        "-lpthread",
    ]
    try:
        done = subprocess.run(command, capture_output=True, timeout=120, check=False)
        if done.returncode != 0:
            return None
        os.replace(partial, target)
        _remove_older_builds(target)
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def calls_in_this_process() -> int | None:
    """Products the library took over in this process; None where it is not loaded."""
    try:
        counter = ctypes.c_ulong.in_dll(ctypes.CDLL(None), COUNTER)
    except ValueError:
        return None
    return counter.value
