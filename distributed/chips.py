"""What the step-time model knows of machines and links before it measures them: Apple
silicon chips' memory bandwidth and GPU arithmetic (the published figures, each with its
source), the chip of this host, and the cost of a collective over each kind of link.

A decode step reads every weight a rank holds once, so a Mac's speed is its memory
bandwidth; a prefill multiplies many tokens against each weight, so it is the GPU's
arithmetic. Where the ranks run, distributed/step_probe.py measures both (and the link)
at start; these tables answer `./launch.sh plan` for machines described by hand and for
Macs before anything runs.
"""

from __future__ import annotations

import platform
import re
import subprocess
from dataclasses import dataclass

# Apple's own specification pages (memory bandwidth), one per generation.
_M1 = "apple.com/newsroom/2021/10/introducing-m1-pro-and-m1-max (M1 Ultra: 2022/03)"
_M2 = "apple.com/newsroom/2023/06/apple-introduces-m2-ultra (M2: 2022/06, M2 Pro/Max: 2023/01)"
_M3 = "apple.com/newsroom/2023/10/apple-unveils-m3-m3-pro-and-m3-max (M3 Ultra: 2025/03)"
_M4 = "apple.com/mac-mini/specs (M4, M4 Pro); apple.com/mac-studio/specs (M4 Max)"
_M5 = "apple.com/newsroom/2025/10 (M5); Apple's press release of 2026-03-03 (M5 Pro, M5 Max)"
# GPU FP32 TFLOPS: Apple does not publish them; these are the figures Wikipedia's "Apple
# M1" ... "Apple M5" pages list (GPU cores x ALUs x clock), for the largest GPU of each chip.
_TFLOPS = "en.wikipedia.org/wiki/Apple_M1 ... Apple_M5 (GPU FP32, largest GPU option)"


@dataclass(frozen=True)
class Chip:
    """One Apple silicon chip: its memory bandwidth (GB/s, Apple's figure) and its GPU's
    FP32 arithmetic (TFLOPS; Apple GPUs run float16 at the same rate)."""

    name: str
    bandwidth_gb_s: float
    gpu_tflops: float
    source: str


CHIPS: tuple[Chip, ...] = (
    Chip("M1", 68.25, 2.6, _M1),
    Chip("M1 Pro", 200, 5.2, _M1),
    Chip("M1 Max", 400, 10.4, _M1),
    Chip("M1 Ultra", 800, 21.2, _M1),
    Chip("M2", 100, 3.6, _M2),
    Chip("M2 Pro", 200, 6.8, _M2),
    Chip("M2 Max", 400, 13.6, _M2),
    Chip("M2 Ultra", 800, 27.2, _M2),
    Chip("M3", 100, 4.1, _M3),
    Chip("M3 Pro", 150, 7.4, _M3),
    Chip("M3 Max", 400, 16.4, _M3),  # the 30-core GPU version: 300 GB/s
    Chip("M3 Ultra", 819, 32.8, _M3),
    Chip("M4", 120, 4.3, _M4),
    Chip("M4 Pro", 273, 9.2, _M4),
    Chip("M4 Max", 546, 18.4, _M4),  # the 32-core GPU version: 410 GB/s
    Chip("M5", 153, 5.7, _M5),
    Chip("M5 Pro", 307, 11.5, _M5),
    Chip("M5 Max", 614, 23.0, _M5),
)
CHIP_SOURCES = {"bandwidth": "Apple (per chip: `source`)", "gpu_tflops": _TFLOPS}


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower().removeprefix("apple"))


def chip_named(text: str) -> Chip:
    """The chip called `text` ("M2 Ultra", "apple m2 ultra", "m2ultra"); ValueError listing
    every known chip when there is none."""
    wanted = _key(text)
    for chip in CHIPS:
        if _key(chip.name) == wanted:
            return chip
    known = ", ".join(chip.name for chip in CHIPS)
    raise ValueError(f"unknown chip {text!r}: known Apple chips are {known}")


def this_chip() -> str:
    """This host's Apple chip as macOS names it ("M2 Ultra"), or "" elsewhere."""
    if platform.system() != "Darwin":
        return ""
    try:
        brand = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return brand.removeprefix("Apple ").strip()


# ---- links ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """What one collective costs on a link: `latency_us`, a small all_sum between two ranks
    (every extra rank of a ring adds one more hop, a mesh none), plus the bytes over
    `gb_s`; where measured, the bytes a rank moves past `bulk_bytes` at `bulk_gb_s` (a
    prefill chunk's all_sum: 3.3 MB of them cost 20-75 ms over the loopback here, where
    the line through a decode's sizes gave 2.5). `source` says where the figures come
    from."""

    name: str
    latency_us: float
    gb_s: float
    topology: str  # "ring" (MLX's ring backend over TCP) or "mesh" (jaccl, every pair cabled)
    source: str
    bulk_bytes: float = 0.0
    bulk_gb_s: float = 0.0  # 0: the line holds at every size

    def traffic(self, kind: str, nbytes: float, ranks: int) -> tuple[int, float]:
        """(hops, bytes each rank moves) of one collective: an all_sum of `nbytes` (the
        ring's 2 (R-1) / R of them cross each link), a hand-over ("send") of `nbytes` to
        the next stage, or an all_gather of every rank's `nbytes` to every rank."""
        if kind == "send":
            return 1, nbytes
        if ranks <= 1:
            return 0, 0.0
        hops = collective_hops(self.topology, ranks)
        if kind == "all_sum":
            return hops, 2 * (ranks - 1) / ranks * nbytes
        return hops, (ranks - 1) * nbytes

    def ms(self, kind: str, nbytes: float, ranks: int) -> float:
        """One collective's time: each hop's latency plus the bytes over the rate."""
        hops, moved = self.traffic(kind, nbytes, ranks)
        line = min(moved, self.bulk_bytes) if self.bulk_gb_s else moved
        bulk = (moved - line) / (self.bulk_gb_s * 1e6) if self.bulk_gb_s else 0.0
        return hops * self.latency_us / 1e3 + line / (self.gb_s * 1e6) + bulk

    def describe(self) -> str:
        """The link's figures in a line: `25 us + 8 GB/s a collective`."""
        bulk = ""
        if self.bulk_gb_s:
            bulk = f", past {self.bulk_bytes / 1e3:.0f} KB {self.bulk_gb_s:.2f} GB/s"
        return f"{self.latency_us:.0f} us + {self.gb_s:.2f} GB/s a collective{bulk}"

    def all_sum_ms(self, nbytes: float, ranks: int) -> float:
        """One all_sum of `nbytes` among `ranks` ranks."""
        return self.ms("all_sum", nbytes, ranks)


def collective_hops(topology: str, ranks: int) -> int:
    """Latencies a collective among `ranks` pays in turn: every extra rank of a ring adds a
    hop, a mesh (every pair cabled) has one."""
    return ranks - 1 if topology == "ring" else 1


LINKS: tuple[Link, ...] = (
    Link(
        "jaccl",
        25,
        8.0,
        "mesh",
        "RDMA over Thunderbolt 5: a 4 KB all_sum about 25 us (seeds: Kimi K2.5 on 2 Mac Studios"
        ", 3.4 ms of collectives in a 47.8 ms step, 2 a layer over 61 layers); 80 Gb/s cable",
    ),
    Link(
        "ring-thunderbolt",
        300,
        1.5,
        "ring",
        "TCP over a Thunderbolt bridge: about 300 us (jeffgeerling.com/blog/2025/"
        "15-tb-vram-on-mac-studio-rdma-over-thunderbolt-5: RDMA 'from 300us down to <50us');"
        " 10-20 Gb/s effective (the seeds' 2 x Mac mini M4 README)",
    ),
    Link(
        "ring-local",
        160,
        2.0,
        "ring",
        "ranks on one machine over 127.0.0.1: 0.16 ms an all_sum of a step's activations at"
        " 2 ranks (docs/BENCHMARKS.md, bench/collectives.py)",
    ),
)


def link_named(text: str) -> Link:
    """The link called `text`; ValueError listing the known ones."""
    for link in LINKS:
        if link.name == text.strip().lower():
            return link
    known = ", ".join(link.name for link in LINKS)
    raise ValueError(
        f"unknown link {text!r}: known links are {known}, or give its cost as "
        "LATENCY_US:GB_S (e.g. 50:6)"
    )


def parse_link(text: str) -> Link:
    """A link by name or as LATENCY_US:GB_S[:mesh] (a measured one)."""
    parts = text.strip().split(":")
    if len(parts) in (2, 3) and all(_is_number(p) for p in parts[:2]):
        latency, rate = float(parts[0]), float(parts[1])
        if latency < 0 or rate <= 0:
            raise ValueError(f"link {text!r}: latency must be >= 0 us and GB/s above 0")
        topology = parts[2] if len(parts) == 3 else "ring"
        if topology not in ("ring", "mesh"):
            raise ValueError(f"link {text!r}: the topology must be ring or mesh")
        return Link(f"{latency:g} us, {rate:g} GB/s", latency, rate, topology, "given by hand")
    return link_named(text)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
