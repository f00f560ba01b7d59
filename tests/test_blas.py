"""The Linux CPU layer (launcher/cpu_layer.py): its gate, this host's OpenBLAS (the kernels
named for a CPU the library does not know, and the line each rank logs about them),
native/sgemm_rows.c in front of it, and NATIVE_KERNELS. Each check asks the real library
in a fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.command import ROOT
from launcher.cpu_layer import OPENBLAS, cpu_flags

pytestmark = pytest.mark.skipif(not OPENBLAS.exists(), reason="no Debian OpenBLAS here")

AVX512 = "fpu sse sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl"
PROBE = """
import ctypes, json, sys
from pathlib import Path
from launcher.cpu_layer import OPENBLAS, kernels
name = ctypes.CDLL(str(OPENBLAS)).openblas_get_corename
name.restype = ctypes.c_char_p
environ = json.loads(sys.argv[2])
print(json.dumps([name().decode(), kernels(environ, Path(sys.argv[1]))]))
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


@pytest.mark.host_dependent("the kernels OpenBLAS picks for this CPU, or the ones we name")
def test_the_kernels_reach_the_ranks_and_their_log_line(tmp_path):
    """scripts/rank.sh execs each rank through `launcher.command exec`; server.py logs
    cpu_layer.in_use() once the model is loaded."""
    library_core, kernels = _probe(tmp_path, " ".join(sorted(cpu_flags())))
    probe = "from launcher.cpu_layer import in_use; print(in_use())"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    args = [sys.executable, "-m", "launcher.command", "exec", "-c", probe]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    expected = kernels.get("OPENBLAS_CORETYPE", library_core)
    assert f", {expected} kernels" in done.stdout, done.stdout
    assert done.stdout.startswith("OpenBLAS ")


# ---- native/sgemm_rows.c: products of a few rows, in front of OpenBLAS --------------------

ROWS_PROBE = """
import ctypes, json, sys
import numpy as np
from launcher.cpu_layer import calls_in_this_process
sgemm = ctypes.CDLL(None).cblas_sgemm
sgemm.restype = None
P, F = ctypes.c_void_p, ctypes.c_float
rng = np.random.default_rng(0)
worst, cases = 0.0, 0
# rows x columns x depth; 131 columns are split among the library's threads; 1,031 and more
# against a weight stored [in, out] run panel_rows (fewer go on to OpenBLAS); 14 and 16 rows
# take two blocks of rows (12 on AVX-512, 6 on AVX2); 97 and 1,040 columns run past the
# weight rows a block fetches ahead
SHAPES = ((1, 37, 19), (3, 5, 16), (4, 33, 7), (5, 9, 11), (9, 1, 13), (1, 1, 5), (11, 131, 45),
          (3, 1031, 21), (11, 1100, 9), (14, 97, 70), (16, 1040, 23))
for order in (101, 102):
    for ta in (111, 112):
        for tb in (111, 112):
            for m, n, k in SHAPES:
                a = rng.standard_normal((m, k) if ta == 111 else (k, m), dtype=np.float32)
                b = rng.standard_normal((k, n) if tb == 111 else (n, k), dtype=np.float32)
                c = rng.standard_normal((m, n), dtype=np.float32)
                want = 0.5 * ((a if ta == 111 else a.T) @ (b if tb == 111 else b.T)) + 2 * c
                if order == 102:  # column-major: each matrix is the transpose in memory
                    a, b, c = (np.ascontiguousarray(x.T) for x in (a, b, c))
                pad = 3  # leading dimensions wider than the matrices
                a2 = np.zeros((a.shape[0], a.shape[1] + pad), np.float32); a2[:, : a.shape[1]] = a
                b2 = np.zeros((b.shape[0], b.shape[1] + pad), np.float32); b2[:, : b.shape[1]] = b
                c2 = np.zeros((c.shape[0], c.shape[1] + pad), np.float32); c2[:, : c.shape[1]] = c
                sgemm(order, ta, tb, m, n, k, F(0.5), P(a2.ctypes.data), a2.shape[1],
                      P(b2.ctypes.data), b2.shape[1], F(2.0), P(c2.ctypes.data), c2.shape[1])
                got = c2[:, : c.shape[1]]
                got = got.T if order == 102 else got
                worst, cases = max(worst, float(np.abs(got - want).max())), cases + 1
import time
import mlx.core as mx
before, mlx_error = calls_in_this_process(), 0.0
for rows in (1, 8, 1, 8):  # the helper threads spin, then sleep (1 ms apart) and wake
    x, w = mx.random.normal((rows, 300)), mx.random.normal((200, 300))
    error = mx.abs(x @ w.T - mx.sum(x[:, None] * w[None], axis=2)).max()
    mlx_error = max(mlx_error, float(error))
    time.sleep(0.001)
calls = calls_in_this_process() - before
# back-to-back products of changing widths, from two threads at once (ctypes lets go of
# the GIL): a product's chunks must never mix with the next one's
from concurrent.futures import ThreadPoolExecutor
def products(seed):
    local, worst_here = np.random.default_rng(seed), 0.0
    for n in local.integers(64, 1400, 300):
        a = local.standard_normal((3, 40), dtype=np.float32)
        b = local.standard_normal((int(n), 40), dtype=np.float32)
        c = np.empty((3, int(n)), np.float32)
        sgemm(101, 111, 112, 3, int(n), 40, F(1.0), P(a.ctypes.data), 40,
              P(b.ctypes.data), 40, F(0.0), P(c.ctypes.data), int(n))
        worst_here = max(worst_here, float(np.abs(c - a @ b.T).max()))
        bt = np.ascontiguousarray(b.T)  # the weight stored [in, out]: the other kernel
        sgemm(101, 111, 111, 3, int(n), 40, F(1.0), P(a.ctypes.data), 40,
              P(bt.ctypes.data), int(n), F(0.0), P(c.ctypes.data), int(n))
        worst_here = max(worst_here, float(np.abs(c - a @ bt).max()))
    return worst_here
with ThreadPoolExecutor(2) as pool:
    worst = max(worst, *pool.map(products, (1, 2)))
print(json.dumps([worst, cases, calls, mlx_error]))
"""


def test_few_row_products_equal_openblas_and_mlx_uses_them():
    """Every order, transposition, padded leading dimension, alpha and beta through the
    preloaded library against numpy (131 columns: split among its threads); and MLX's
    matmuls of 1 and 8 rows go through it, also after its helper threads went to sleep;
    and 1200 products of changing widths and both weight layouts from two threads at once."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    args = [sys.executable, "-m", "launcher.command", "exec", "-c", ROWS_PROBE]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    worst, cases, mlx_calls, mlx_error = json.loads(done.stdout)
    assert cases == 88 and worst < 1e-4, (cases, worst)
    assert mlx_calls == 4 and mlx_error < 1e-3, (mlx_calls, mlx_error)


def test_the_peer_gets_openblas_alone_and_ours_the_few_row_library_first():
    from launcher.cpu_layer import preload

    ours = preload({"LD_PRELOAD": str(OPENBLAS)})["LD_PRELOAD"].split(":")
    assert len(ours) == 2 and Path(ours[0]).name.startswith("sgemm_rows-"), ours
    assert ours[1] == str(OPENBLAS)
    assert preload({"LD_PRELOAD": ":".join(ours)}, few_rows=False)["LD_PRELOAD"] == str(OPENBLAS)
    assert "LD_PRELOAD" not in preload({"LD_PRELOAD": ":".join(ours)})  # already so


def test_a_build_is_named_for_its_cpu_and_replaces_that_cpus_older_builds(tmp_path):
    """`-march=native` code is kept per kind of CPU (hosts sharing a checkout keep one
    each); a changed source's build removes this CPU's older ones and the unkeyed names."""
    from launcher.cpu_layer import SOURCE, build, cpu_key, library_path

    source, build_dir = tmp_path / "sgemm_rows.c", tmp_path / "lib"
    source.write_text(SOURCE.read_text())
    build_dir.mkdir()
    other_cpu = build_dir / "sgemm_rows-00000000-aaaaaaaaaaaa.so"
    unkeyed = build_dir / "sgemm_rows-bbbbbbbbbbbb.so"
    for stale in (other_cpu, unkeyed):
        stale.write_bytes(b"")
    first = build(source, build_dir)
    assert first == library_path(source, build_dir), first
    assert first.name.startswith(f"sgemm_rows-{cpu_key()}-")
    source.write_text(SOURCE.read_text() + "\n/* a changed source */\n")
    second = build(source, build_dir)
    assert second is not None and second != first
    assert sorted(p.name for p in build_dir.iterdir()) == sorted([second.name, other_cpu.name])
    assert build(source, build_dir) == second  # built once


# ---- the gate and the switch ------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("OPENBLAS_CORETYPE", "LD_PRELOAD", "NATIVE_KERNELS")
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def _blas_env(env: dict[str, str]) -> dict[str, str]:
    args = [sys.executable, "-m", "launcher.command", "blas-env"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines()]
    return {key: value.strip("'") for key, value in lines}


def test_native_kernels_off_keeps_the_library_out_of_every_preload(tmp_path):
    """blas-env, the exec path every rank takes (also with the library inherited in its
    LD_PRELOAD) and the tests' clusters' preload: OpenBLAS, and no sgemm_rows."""
    from launcher.cpu_layer import build, preload

    exported = _blas_env(_clean_env(NATIVE_KERNELS="off", ENV_FILE=str(tmp_path / "none")))
    assert exported["NATIVE_KERNELS"] == "off"
    assert exported["LD_PRELOAD"] == str(OPENBLAS), exported
    inherited = f"{build()}:{OPENBLAS}"
    assert preload({"NATIVE_KERNELS": "off", "LD_PRELOAD": inherited}) == {
        "LD_PRELOAD": str(OPENBLAS)
    }
    probe = "import os; from launcher.cpu_layer import in_use; print(os.environ['LD_PRELOAD'])"
    probe += "; print(in_use())"
    env = _clean_env(NATIVE_KERNELS="off", LD_PRELOAD=inherited)
    args = [sys.executable, "-m", "launcher.command", "exec", "-c", probe]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    preloaded, line = done.stdout.splitlines()
    assert preloaded == str(OPENBLAS)
    assert line.endswith("few-row products: OpenBLAS (NATIVE_KERNELS=off)"), line
    # and auto (the default, from .env too) puts it first
    exported = _blas_env(_clean_env(ENV_FILE=str(tmp_path / "none")))
    assert exported["NATIVE_KERNELS"] == "auto"
    assert Path(exported["LD_PRELOAD"].split(":")[0]).name.startswith("sgemm_rows-"), exported


def test_a_bad_native_kernels_value_stops_the_rank_with_the_values_allowed():
    env = _clean_env(NATIVE_KERNELS="no")
    args = [sys.executable, "-m", "launcher.command", "exec", "-c", "print('ran')"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "ran" not in done.stdout
    assert "invalid setting NATIVE_KERNELS='no': one of 'auto', 'off'" in done.stderr


def test_the_gate_asks_mlx_for_its_device_not_for_files(tmp_path):
    """A Linux host whose MLX computes on a GPU (CUDA) has OpenBLAS's file too: the gate
    says no, and an inherited sgemm_rows leaves the preload. The stand-in `mlx` package
    answers what mlx-cuda's would: its default device is the GPU."""
    fake = tmp_path / "mlx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text("cpu, gpu = 'cpu', 'gpu'\ndef default_device():\n  return gpu\n")
    from launcher.cpu_layer import build

    env = _clean_env(PYTHONPATH=str(tmp_path), LD_PRELOAD=f"{build()}:/lib/other.so")
    probe = "from launcher import cpu_layer; print(cpu_layer.applies(), cpu_layer.preload())"
    args = [sys.executable, "-c", probe]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False {'LD_PRELOAD': '/lib/other.so'}", done.stdout
    exported = _blas_env(env | {"ENV_FILE": str(tmp_path / "none")})
    assert exported == {"NATIVE_KERNELS": "auto", "LD_PRELOAD": "/lib/other.so"}, exported


MISSING_PROBE = """
import ctypes, os, sys
if sys.argv[1] == "later":  # OpenBLAS loaded after the library: found at the first product
    ctypes.CDLL(sys.argv[2], mode=os.RTLD_GLOBAL)
sgemm = ctypes.CDLL(None).cblas_sgemm
sgemm.restype = None
F, m, n, k = ctypes.c_float, 32, 8, 4  # 32 rows: more than the library takes over
a, b, c = (F * 128)(*[1.0] * 128), (F * 32)(*[1.0] * 32), (F * 256)()
sgemm(101, 111, 112, m, n, k, F(1.0), a, k, b, k, F(0.0), c, n)
print(c[0], c[255])
"""


def test_products_it_passes_on_find_openblas_late_or_stop_with_the_reason():
    """The library alone in the preload: a product it does not compute itself finds the
    cblas_sgemm of a library loaded after it, or, where there is none, stops the process
    with a message (it had called a null pointer)."""
    from launcher.cpu_layer import build

    env = _clean_env(LD_PRELOAD=str(build()))
    run = [sys.executable, "-c", MISSING_PROBE]
    later = subprocess.run([*run, "later", str(OPENBLAS)], env=env, capture_output=True, text=True)
    assert later.returncode == 0 and later.stdout.split() == ["4.0", "4.0"], later.stderr
    alone = subprocess.run([*run, "alone"], env=env, capture_output=True, text=True)
    assert alone.returncode == -6, (alone.returncode, alone.stderr)  # SIGABRT
    assert "no cblas_sgemm after this library" in alone.stderr, alone.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("switch", ["off", "auto"])
def test_every_rank_of_a_cluster_follows_native_kernels(tiny_llama, switch):
    """Two real ranks: with NATIVE_KERNELS=off neither has the library (each says so in
    its log line); with auto both run it."""
    from launcher.local_cluster import Cluster

    with Cluster(tiny_llama, ranks=2, env={"NATIVE_KERNELS": switch}) as cluster:
        log = cluster.log_path.read_text()
    rows = "OpenBLAS (NATIVE_KERNELS=off)" if switch == "off" else "native/sgemm_rows.c"
    for rank in (0, 1):
        assert re.search(
            rf"r{rank} INFO matrix products: .*few-row products: {re.escape(rows)}$", log, re.M
        ), log
