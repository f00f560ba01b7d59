"""The machines and the link `./launch.sh plan` predicts with (distributed/plan_speed.py),
before any rank runs.

- This machine: measured now, in a child with the ranks' preload, OpenBLAS threads and
  attention kernel (distributed/step_probe.py through `python -m launcher.command exec`),
  once per thread count the rank counts in the table would give each rank.
- A worker: its Apple chip (read over SSH by launcher/detect.py) from distributed/chips.py's
  table, else (a Linux worker) taken to be like this machine, as the lines say.
- Described by hand (`--host CHIP:MEMORY`, repeated, one per rank): the chip's table.
- The link: `--link` (a name from distributed/chips.py or LATENCY_US:GB_S), else by
  DISTRIBUTED_BACKEND and mode: ranks on this machine talk over 127.0.0.1, jaccl is RDMA
  over Thunderbolt 5, ring between hosts is TCP over a Thunderbolt bridge.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from config.settings import Settings
from distributed.chips import Link, chip_named, link_named, parse_link
from distributed.hosts import RankHost
from distributed.speed_records import crowding_of, machine_from_record
from distributed.step_model import Machine, Speed
from launcher import cpu_layer
from launcher.command import ROOT

# ASSUMED: the share of a Mac's memory that Metal lets MLX keep resident (macOS's
# recommendedMaxWorkingSetSize, which `mx.device_info()` reports on a running Mac).
WORKING_SET = 0.75
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(g|gb|gib|t|tb|tib)?\s*$", re.IGNORECASE)


@dataclass
class Site:
    """One RankHost and one Machine per rank, the link, and where the figures came from."""

    hosts: list[RankHost]
    machines: list[Machine]
    link: Link
    lines: list[str] = field(default_factory=list)
    by_ranks: dict[int, list[Machine]] = field(default_factory=dict)  # local: per rank count

    def speed(self, ranks: int) -> Speed:
        machines = self.by_ranks.get(ranks) or self.machines[:ranks]
        return Speed(tuple(machines), self.link, crowding_of(self.hosts[:ranks]))


def parse_host(text: str) -> tuple[str, int]:
    """ "M4 Pro:64GB" -> (chip name, memory bytes); ValueError saying what is wrong."""
    name, _, memory = text.rpartition(":")
    if not name:
        raise ValueError(f"--host {text!r}: give CHIP:MEMORY, e.g. 'M4 Pro:64GB'")
    chip = chip_named(name)
    found = _MEMORY.match(memory)
    if found is None:
        raise ValueError(f"--host {text!r}: memory {memory!r} must be like 16GB or 0.5TB")
    unit = 2**40 if (found.group(2) or "g").lower().startswith("t") else 2**30
    return chip.name, int(float(found.group(1)) * unit)


def described(hosts: list[str], link: str | None) -> Site:
    """Hosts described by hand: Apple chips and their memory; the link by name or cost."""
    ranks, machines = [], []
    for index, text in enumerate(hosts):
        name, memory = parse_host(text)
        usable = int(memory * WORKING_SET)
        ranks.append(RankHost(host=f"host {index + 1} ({name})", cores=8, memory_bytes=usable))
        machines.append(Machine.of_chip(chip_named(name), usable))
    chosen = parse_link(link) if link else link_named("jaccl")
    lines = [
        f"machines described by hand: Apple's bandwidth and GPU figures "
        f"(distributed/chips.py), {WORKING_SET:.0%} of each memory usable by MLX (assumed)",
        f"link: {chosen.name}, {chosen.latency_us:g} us + {chosen.gb_s:g} GB/s a collective "
        f"({chosen.source})",
    ]
    return Site(ranks, machines, chosen, lines)


def probe_here(model_dir: Path, threads: int) -> Machine:
    """This machine's rates for the model, with `threads` OpenBLAS threads as a rank has."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    # as a rank runs it: the CPU backend's attention and SwiGLU installed (server.py does so)
    code = (
        "from engine import cpu_kernels; cpu_kernels.install(); "
        f"from distributed.step_probe import main; raise SystemExit(main([{str(model_dir)!r}]))"
    )
    argv = [sys.executable, "-m", "launcher.command", "exec", "--", "-c", code]
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"measuring this machine failed: {done.stderr.strip()[-500:]}")
    return machine_from_record(json.loads(done.stdout.strip().splitlines()[-1]))


def _default_link(settings: Settings) -> Link:
    if not settings.remote_mode:
        return link_named("ring-local")
    return link_named("jaccl" if settings.distributed_backend == "jaccl" else "ring-thunderbolt")


def _ranks_threads(ranks: int, threads: int) -> str:
    """'1 rank with 2 threads', '2 ranks with 1 thread each'."""
    plural = "s" if threads > 1 else ""
    if ranks == 1:
        return f"1 rank with {threads} thread{plural}"
    return f"{ranks} ranks with {threads} thread{plural} each"


def site(
    settings: Settings,
    model_dir: Path,
    hosts: list[RankHost],
    chips: list[str | None],
    link: str | None,
) -> Site:
    """The configured hosts (`chips`: each worker's Apple chip or None) as the plan sees
    them: this machine measured, workers by their chips."""
    chosen = parse_link(link) if link else _default_link(settings)
    lines = [
        f"link: {chosen.name}, {chosen.latency_us:g} us + {chosen.gb_s:g} GB/s a collective "
        f"({chosen.source}); the ranks measure it at start (`./launch.sh status`)"
    ]
    cores = hosts[0].cores
    if not settings.remote_mode:
        by_ranks: dict[int, list[Machine]] = {}
        measured: dict[int, Machine] = {}
        how: list[str] = []
        for ranks in range(1, len(hosts) + 1):
            threads = int(cpu_layer.threads(ranks, {}).get("OPENBLAS_NUM_THREADS", cores))
            if threads not in measured:
                measured[threads] = probe_here(model_dir, threads)
            by_ranks[ranks] = [measured[threads]] * ranks
            how.append(_ranks_threads(ranks, threads))
        lines.insert(0, f"this machine measured now, as its ranks would run: {', '.join(how)}")
        return Site(hosts, by_ranks[len(hosts)], chosen, lines, by_ranks)
    here = probe_here(model_dir, cores)
    machines = [here]
    for host, chip in zip(hosts[1:], chips, strict=True):
        if chip:
            try:
                machines.append(Machine.of_chip(chip_named(chip), host.memory_bytes))
                continue
            except ValueError as exc:
                lines.append(f"{host.host}: {exc}; taken to be like this machine")
        else:
            lines.append(f"{host.host}: no Apple chip; its rates taken to be this machine's")
        machines.append(here)
    lines.insert(0, "this machine measured now; workers from their chips' published figures")
    return Site(hosts, machines, chosen, lines)
