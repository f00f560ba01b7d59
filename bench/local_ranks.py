"""Start a few ranks of a command on 127.0.0.1 without mlx.launch, whose launcher
busy-reads the ranks' stdin and takes a core: a hostfile of free ports, MLX_RANK for each,
one OpenBLAS thread each (as launch.sh gives ranks sharing 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from launcher.hostfile import random_free_port_run


def run_local_ranks(count: int, command: list[str]) -> None:
    """Run `command` as ranks 0..count-1 of one ring on this machine; SystemExit naming
    the exit codes where a rank failed."""
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        first = random_free_port_run(count)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in range(first, first + count)]))
        env = os.environ | {"MLX_HOSTFILE": str(hostfile), "OPENBLAS_NUM_THREADS": "1"}
        ranks = [subprocess.Popen(command, env=env | {"MLX_RANK": str(r)}) for r in range(count)]
        codes = [rank.wait() for rank in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
