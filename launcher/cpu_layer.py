"""The Linux CPU layer: what makes MLX's CPU device fast on Linux x86_64, behind one gate.

MLX's Linux CPU wheel ships a slow reference BLAS. On a host where MLX computes on its CPU
device (`applies()`: Linux, x86_64, no Metal or CUDA device) this module owns all of:
- the preload (`preload`): Debian's OpenBLAS (`libopenblas0-pthread`; float32 matmul many
  times faster: docs/BENCHMARKS.md, "Figures behind the code"), and in front of it
  native/sgemm_rows.c, our sgemm for a few rows of activations (decode steps), unless
  NATIVE_KERNELS=off;
- OpenBLAS's kernels (`kernels`): OPENBLAS_CORETYPE where the library does not know the CPU;
- building native/sgemm_rows.c (`build`), once per source version and kind of CPU;
- the line each rank logs about it (`in_use`). server.py stores the layers by
  LINEAR_LAYOUT (engine/cpu_linear.py) only where `applies()`.
A Linux host whose MLX runs on CUDA gets none of it, whatever files it has.

The gate asks MLX itself (`import mlx.core`, far dearer) after the cheap checks
(platform, machine); it runs where ranks are started (`launcher.command exec`, `blas-env`,
the tests' and benchmarks' clusters), never in the API process or the supervisor. Those
ask nothing: `threads` (OpenBLAS threads per local rank) is only a number for whichever
OpenBLAS a rank loads, and is not gated.

Standard library only, apart from the gate's own import of mlx.core: every rank's exec path
imports this module before it becomes Python with MLX, on its own host. NATIVE_KERNELS is
read from the environment given (launch.sh's job puts the setting there for every rank).
The library is built into .venv/lib (a few hundred milliseconds with cc), atomically, so
ranks that start together do not trip over each other's build. `-march=native` code can use
instructions another CPU lacks, so the name carries the CPU's model and flags: hosts that
share a checkout (NFS) keep one build each. A new build removes this CPU's builds of older
sources (a rank still running one keeps its mapping). Where no C compiler is found or the
build fails, the ranks run without it (the "matrix products" log line says so) and
products of a few rows go through OpenBLAS's sgemm, about half as fast.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "native" / "sgemm_rows.c"
BUILD_DIR = ROOT / ".venv" / "lib"
PREFIX = "sgemm_rows-"  # of every build's file name: sgemm_rows-<cpu>-<source>.so
COUNTER = "mlx_ring_sgemm_rows_calls"  # exported by the library: products it took over
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
CPUINFO = Path("/proc/cpuinfo")
SWITCH = "NATIVE_KERNELS"  # config/settings.py's native_kernels: auto | off
# OpenBLAS picks its kernels by CPU model, and one older than the CPU falls back to its
# SSE3 "Prescott" kernels: Debian 12's 0.3.21 on a Xeon of family 6, model 207 (AVX-512)
# multiplied float32 several times faster with the "SkylakeX" kernels it has
# (OPENBLAS_CORETYPE), and a batched prefill ran faster (docs/BENCHMARKS.md, "Figures
# behind the code"). Kernels by the CPU's flags:
KERNELS = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Haswell", {"avx2", "fma"}),
    ("Sandybridge", {"avx"}),
)

Environ = Mapping[str, str]


@functools.cache
def applies() -> bool:
    """The gate: whether MLX computes on its CPU device on Linux x86_64 here (no Metal, no
    CUDA). False where mlx cannot be imported: then there is nothing to speed up."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        import mlx.core as mx
    except ImportError:
        return False
    return bool(mx.default_device() == mx.cpu)


def native_kernels(environ: Environ = os.environ) -> bool:
    """Whether NATIVE_KERNELS (in `environ`) lets our kernels in: `auto` (the default) or
    `off`; anything else is refused with the values allowed."""
    value = environ.get(SWITCH, "auto") or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"invalid setting {SWITCH}={value!r}: one of 'auto', 'off'")
    return value == "auto"


# ---- the preload -----------------------------------------------------------------------


def preload(environ: Environ = os.environ, few_rows: bool = True) -> dict[str, str]:
    """What to add to `environ` for a process that runs MLX: LD_PRELOAD with this host's
    OpenBLAS first, where `applies()` and it is installed, and the kernels for this CPU
    where the library does not know it (`kernels`); before OpenBLAS, with `few_rows` and
    NATIVE_KERNELS=auto, our sgemm for products of a few rows, built here on first use.
    Where our library is not wanted, it is taken out of an LD_PRELOAD inherited. The
    benchmarks' peer passes `few_rows=False`: OpenBLAS alone."""
    current = [path for path in environ.get("LD_PRELOAD", "").split(":") if path]
    ours = [path for path in current if PREFIX in Path(path).name]
    if not applies() or not OPENBLAS.exists():
        return {"LD_PRELOAD": ":".join(p for p in current if p not in ours)} if ours else {}
    env = kernels(environ)
    shim = build() if few_rows and native_kernels(environ) else None
    wanted = [str(shim)] if shim is not None else []
    wanted += [str(OPENBLAS)]
    wanted += [path for path in current if path not in wanted and path not in ours]
    if wanted != current:
        env["LD_PRELOAD"] = ":".join(wanted)
    return env


def threads(local_ranks: int, environ: Environ = os.environ) -> dict[str, str]:
    """OpenBLAS threads for ranks that share this machine's cores (unless already set).

    OpenBLAS starts one busy-waiting thread per core in every rank, so local ranks fight
    over the cores: ranks sharing the cores decoded far slower with its default threads
    (docs/BENCHMARKS.md, "Figures behind the code").
    """
    if local_ranks <= 1 or "OPENBLAS_NUM_THREADS" in environ:
        return {}
    return {"OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // local_ranks))}


# ---- OpenBLAS's kernels ----------------------------------------------------------------


def first_cpu(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """The fields of the first CPU in Linux's cpuinfo ("flags", "model name", ...); none
    where it is not there (macOS, other systems)."""
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


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The instruction-set flags of this machine's first CPU (none where Linux's cpuinfo is
    not there)."""
    return set(first_cpu(cpuinfo).get("flags", "").split())


def kernels(environ: Environ = os.environ, cpuinfo: Path = CPUINFO) -> dict[str, str]:
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
    for name, needs in KERNELS:
        if needs <= flags:
            return {"OPENBLAS_CORETYPE": name}
    return {}


def in_use() -> str | None:
    """ "OpenBLAS 0.3.21, SkylakeX kernels; few-row products: native/sgemm_rows.c" where
    this process has OpenBLAS, else None."""
    try:
        library = ctypes.CDLL(str(OPENBLAS), mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    library.openblas_get_config.restype = ctypes.c_char_p
    library.openblas_get_corename.restype = ctypes.c_char_p
    version = library.openblas_get_config().decode().split()[:2]
    names = library.openblas_get_corename().decode()
    forced = " (OPENBLAS_CORETYPE)" if os.environ.get("OPENBLAS_CORETYPE") else ""
    if calls_in_this_process() is not None:
        rows = "native/sgemm_rows.c"
    elif not native_kernels():
        rows = f"OpenBLAS ({SWITCH}=off)"
    else:
        rows = "OpenBLAS (native/sgemm_rows.c not built)"
    return f"{' '.join(version)}, {names} kernels{forced}; few-row products: {rows}"


def calls_in_this_process() -> int | None:
    """Products the library took over in this process; None where it is not loaded."""
    try:
        counter = ctypes.c_ulong.in_dll(ctypes.CDLL(None), COUNTER)
    except ValueError:
        return None
    return counter.value


# ---- building native/sgemm_rows.c ------------------------------------------------------


def _digest(data: bytes, length: int) -> str:
    return hashlib.sha256(data).hexdigest()[:length]


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
    flags = ["-O3", "-march=native", "-shared", "-fPIC"]
    command = [compiler, *flags, "-o", partial, str(source), "-ldl", "-lpthread"]
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
