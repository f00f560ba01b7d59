"""The machine a test run ran on, in one line for pytest's header: the processor, its
widest vectors, the BLAS kernels MLX's matrix products take here and MLX's device. Tests
whose outcome depends on these carry the `host_dependent` marker with the reason, and the
run's summary names them beside this line, so a failure on a new kind of host is read with
the host in view."""

from __future__ import annotations

import os
import platform

from launcher.cpu_layer import cpu_flags, first_cpu, in_use

# The widest vector instructions first: what `-march=native` and OpenBLAS build on.
VECTORS = ("avx512f", "avx2", "avx", "sse4_2", "asimd", "neon")


def describe() -> str:
    """ "host: AMD EPYC (x86_64, 2 cores), vectors avx512f; BLAS: OpenBLAS 0.3.21, COOPERLAKE
    kernels; few-row products: native/sgemm_rows.c; MLX 0.32.4 on cpu" """
    cpu = first_cpu()
    name = cpu.get("model name") or platform.processor() or "unknown processor"
    flags = cpu_flags()
    widest = next((v for v in VECTORS if v in flags), "unknown" if not flags else "none")
    blas = in_use() or "none preloaded (Accelerate on macOS, MLX's own elsewhere)"
    try:
        import mlx.core as mx

        runtime = f"MLX {mx.__version__} on {mx.default_device()}"
    except ImportError:
        runtime = "MLX not importable"
    cores = os.cpu_count() or 0
    return (
        f"host: {name} ({platform.machine()}, {cores} cores), vectors {widest}; "
        f"BLAS: {blas}; {runtime}"
    )
