"""Build native/sgemm_rows.c, the few-row sgemm that goes in front of OpenBLAS.

Standard library only: every rank's exec path (launcher/command.py) asks for the library
before it becomes Python with MLX, on its own host. The library is built once per source
version into .venv/lib (a few hundred milliseconds with cc), atomically, so ranks that
start together on one host do not trip over each other's build. Where no C compiler is
found or the build fails, the ranks run without it (the rank's "matrix products" log line
says which) and products of a few rows go through OpenBLAS's sgemm, about half as fast.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "native" / "sgemm_rows.c"
BUILD_DIR = ROOT / ".venv" / "lib"
COUNTER = "mlx_ring_sgemm_rows_calls"  # exported by the library: products it took over


def library_path(source: Path = SOURCE, build_dir: Path = BUILD_DIR) -> Path:
    """Where this version of the source is built (its hash in the name)."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return build_dir / f"sgemm_rows-{digest}.so"


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
    fd, partial = tempfile.mkstemp(prefix=".sgemm_rows-", suffix=".so", dir=build_dir)
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
