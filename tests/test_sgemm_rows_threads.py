"""native/sgemm_rows.c's thread pool under many callers at once: a C driver
(tests/support/sgemm_rows_stress.c) runs products from several threads, each checked
against a plain loop, once under ThreadSanitizer (any data race fails it: moving the
release of the helpers before their last chunk is waited for was caught in 3 s) and
once built as the ranks build it, with more threads and products.

Under ThreadSanitizer OpenBLAS computes on the thread that calls it (its pool of one):
OpenBLAS is not built with the sanitizer, so the handover inside its own pool is invisible
to it, and on hosts where OpenBLAS hands work to a pool thread (its AVX-512 kernels scale C
by beta on one: `sgemm_beta_SKYLAKEX`, `sgemm_beta_COOPERLAKE`) every such product was
reported as a race between the caller and OpenBLAS. Our own pool keeps its helpers, and
the run must show they computed chunks: the library's kernel, its pool and its handover to
OpenBLAS stay under the sanitizer on every host. The ranks' build runs with OpenBLAS's
pool threaded as the ranks run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher.cpu_layer import OPENBLAS, SOURCE

DRIVER = Path(__file__).parent / "support" / "sgemm_rows_stress.c"
COMPILER = shutil.which("cc") or shutil.which("gcc")

pytestmark = [
    pytest.mark.host_dependent(
        "OpenBLAS's AVX-512 kernels hand work to its own pool, which ThreadSanitizer cannot "
        "see into: OpenBLAS runs on the calling thread under the sanitizer"
    ),
    pytest.mark.skipif(not OPENBLAS.exists(), reason="no Debian OpenBLAS here (Linux only)"),
    pytest.mark.skipif(COMPILER is None, reason="no C compiler here"),
]


def _build(tmp_path: Path, flags: list[str]) -> Path | str:
    """The driver linked to a build of the library with `flags`; the compiler's complaint
    where it cannot build them."""
    library, driver = tmp_path / "libsgemm_rows_test.so", tmp_path / "stress"
    steps = (
        [COMPILER, *flags, "-shared", "-fPIC", "-o", library, SOURCE, "-ldl", "-lpthread"],
        # OpenBLAS after the library, and kept though the driver names none of its symbols
        [COMPILER, *flags, "-o", driver, DRIVER, "-Wl,--no-as-needed", library, OPENBLAS]
        + [f"-Wl,-rpath,{tmp_path}", "-lpthread", "-lm"],
    )
    for step in steps:
        done = subprocess.run([str(part) for part in step], capture_output=True, text=True)
        if done.returncode != 0:
            return done.stderr[-1500:]
    return driver


def _run(
    driver: Path, callers: int, products: int, helpers: int, openblas: int | None = None
) -> dict:
    """The driver's result; `helpers`: the library's threads (OpenBLAS's as it loads),
    `openblas`: OpenBLAS's own pool after that (None: as many)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env |= {"OPENBLAS_NUM_THREADS": str(helpers), "TSAN_OPTIONS": "halt_on_error=1"}
    args = [str(driver), str(callers), str(products)]
    args += [] if openblas is None else [str(openblas)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "ThreadSanitizer" not in done.stderr, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["products"] == callers * products
    # most products are the library's own (the rest go on to OpenBLAS): it did run them,
    # and its helpers shared their columns
    assert result["taken_over"] > result["products"] // 2, result
    assert result["helped"] > 0, result
    return result


def test_the_thread_pool_has_no_data_race_under_threadsanitizer(tmp_path):
    driver = _build(tmp_path, ["-fsanitize=thread", "-O1", "-g", "-march=native"])
    if isinstance(driver, str):
        pytest.skip(f"this compiler cannot build with ThreadSanitizer: {driver}")
    result = _run(driver, callers=6, products=150, helpers=4, openblas=1)
    assert result["worst"] < 1e-3, result


def test_many_callers_at_once_get_right_products_from_the_ranks_build(tmp_path):
    driver = _build(tmp_path, ["-O3", "-march=native"])
    assert isinstance(driver, Path), driver
    result = _run(driver, callers=16, products=400, helpers=8)
    assert result["worst"] < 1e-3, result
