"""What a rank compiles or traces on first use, seen from outside the rank.

- MLX's CPU kernels: each fused kernel of a compiled graph is a shared library under
  $TMPDIR/mlx/<version>/cpu, loaded (dlopen) on its first use in the process and never
  unloaded, so /proc/PID/maps lists every kernel the process has used so far;
- the compiled decode's traces: `compiled decode: traced batch ...` lines in server.log
  (LOG_LEVEL=DEBUG), after rank 0's `warm-up: ...` line once it is ready.
"""

from __future__ import annotations

import re
from pathlib import Path


def mapped_kernels(pid: int) -> set[str]:
    """The MLX CPU kernels process `pid` has loaded (Linux)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {Path(line.split()[-1]).name for line in maps.splitlines() if "/cpu/lib" in line}


def traced_after_ready(server_log: Path) -> list[str]:
    """Trace lines any rank logged after rank 0's last warm-up line."""
    lines = server_log.read_text(errors="replace").splitlines()
    ready = max((i for i, line in enumerate(lines) if " r0 INFO warm-up: " in line), default=-1)
    assert ready >= 0, "rank 0 logged no warm-up"
    return [line for line in lines[ready + 1 :] if re.search(r"compiled decode: traced", line)]
