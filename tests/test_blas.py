"""This host's OpenBLAS: the kernels named for a CPU the library does not know, and the
line each rank logs about them. Each check asks the real library in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.command import OPENBLAS, ROOT, cpu_flags

pytestmark = pytest.mark.skipif(not OPENBLAS.exists(), reason="no Debian OpenBLAS here")

AVX512 = "fpu sse sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl"
PROBE = """
import ctypes, json, sys
from pathlib import Path
from launcher.command import OPENBLAS, blas_kernels
name = ctypes.CDLL(str(OPENBLAS)).openblas_get_corename
name.restype = ctypes.c_char_p
environ = json.loads(sys.argv[2])
print(json.dumps([name().decode(), blas_kernels(environ, Path(sys.argv[1]))]))
"""


def _probe(tmp_path: Path, flags: str, environ: dict[str, str] | None = None) -> tuple[str, dict]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    args = [sys.executable, "-c", PROBE, str(cpuinfo), json.dumps(environ or {})]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    library_core, kernels = json.loads(done.stdout)
    return library_core, kernels


def test_a_cpu_the_library_does_not_know_gets_the_kernels_its_flags_allow(tmp_path):
    library_core, kernels = _probe(tmp_path, AVX512)
    # where the library knows this machine's CPU, it keeps its own choice
    assert kernels == ({"OPENBLAS_CORETYPE": "SkylakeX"} if library_core == "Prescott" else {})
    if library_core == "Prescott":
        assert _probe(tmp_path, "fpu sse sse2 avx avx2 fma")[1] == {"OPENBLAS_CORETYPE": "Haswell"}
        assert _probe(tmp_path, "fpu sse sse2 sse3")[1] == {}  # Prescott's own: nothing better


def test_an_operators_choice_is_kept(tmp_path):
    assert _probe(tmp_path, AVX512, {"OPENBLAS_CORETYPE": "Haswell"})[1] == {}


def test_the_kernels_reach_the_ranks_and_their_log_line(tmp_path):
    """scripts/rank.sh execs each rank through `launcher.command exec`; server.py logs
    blas_in_use() once the model is loaded."""
    library_core, kernels = _probe(tmp_path, " ".join(sorted(cpu_flags())))
    probe = "from launcher.command import blas_in_use; print(blas_in_use())"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    args = [sys.executable, "-m", "launcher.command", "exec", "-c", probe]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    expected = kernels.get("OPENBLAS_CORETYPE", library_core)
    assert f", {expected} kernels" in done.stdout, done.stdout
    assert done.stdout.startswith("OpenBLAS ")
