"""Entry for every rank: join the group, load this rank's share of the model, build the
batch engine over it, then serve one of two roles until told to stop.

- rank 0 (leader/): the socket, tokenizer, scheduler and sampler; it broadcasts one step
  plan per step (leader/serve.py);
- every other rank (engine/worker.py): applies each plan to its batch and runs the
  forward, sleeping on the wake channel (no spinning) while idle.

The two roles meet only in the step plan and the step's result (engine/step_plan.py).
SIGTERM or a shutdown message ends every rank with exit 0, once its queued prefix-cache saves
are on disk.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from config.logging_setup import setup_logging
from config.settings import Settings, run_with_settings
from distributed.exits import EXIT_BAD_MODEL, EXIT_PEER_GONE, die
from distributed.group import GroupJoinError, init_group, leader_address
from distributed.loader import ModelLoadError, load_for_rank
from distributed.memory import activation_bytes, prefix_budget
from distributed.overhead import BUFFER_CACHE_BYTES, overhead
from distributed.runtime import RankRuntime
from distributed.wake import WakeError, WakeReceiver, WakeSender, open_wake_channel
from engine import cpu_kernels
from engine.build import LoadedRank, build_engine
from engine.cpu_linear import transpose_linears
from engine.heap import limit_buffer_cache
from engine.last_logits import head_on_last_position
from engine.worker import serve_worker
from ipc.status import RankStatus
from launcher import cpu_layer
from leader.booting import Boot, boot
from leader.serve import serve_leader

log = logging.getLogger("ring")


def _detach_stdin() -> None:
    """Close the pipe mlx.launch relays stdin into (it busy-loops while that stays open)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def main(settings: Settings) -> int:
    try:
        group, ident = init_group(settings.distributed_backend)
    except GroupJoinError as exc:
        setup_logging(settings.log_level, f"r{os.environ.get('MLX_RANK', '?')}")
        log.error("%s", exc)  # the supervisor starts the ranks again
        return 1
    setup_logging(settings.log_level, ident.role)
    log.info(
        "rank %d of %d on %s (backend %s)", ident.rank, ident.world_size, ident.host, ident.backend
    )
    if cpu_kernels.install():
        log.debug("attention and SwiGLU: kernels for MLX's CPU backend (engine/cpu_*.py)")
    cache = limit_buffer_cache(BUFFER_CACHE_BYTES)
    log.debug("MLX buffer cache: at most %d MiB (distributed/overhead.py)", cache // 2**20)
    runtime = RankRuntime.start(
        ident, group, settings.collective_timeout_seconds, settings.ring_profile_collectives
    )
    booted = boot(settings, ident) if ident.is_leader else None
    if booted is None:
        # Ctrl-C reaches every rank of a terminal's job; rank 0 alone decides when to stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready_reports: Callable[[], list[dict[str, Any]]] = list  # the workers' (none: none)
    try:
        wake = open_wake_channel(runtime.broadcaster, leader_address())
        if isinstance(wake, WakeSender) and booted is not None:
            ready_reports = wake.collect_ready_in_background(booted.booting.on_progress)
        loaded = _load(settings, runtime, _progress_reporter(wake, booted))
    except WakeError as exc:
        die(EXIT_PEER_GONE, str(exc))
    mine = _status(settings, runtime, loaded)
    if booted is None:
        assert isinstance(wake, WakeReceiver)
        code = serve_worker(loaded.engine, runtime.broadcaster, wake, mine.model_dump())
    else:
        assert wake is None or isinstance(wake, WakeSender)
        code = serve_leader(settings, runtime, booted, loaded, mine, wake, ready_reports)
    loaded.engine.prefix.close()  # the last turn's queued saves reach the disk
    return code


def _load(
    settings: Settings, runtime: RankRuntime, progress: Callable[[int, int], None]
) -> LoadedRank:
    """This rank's share of the model (the CPU layer's kernels in place where it applies)
    and the engine over it; every rank together."""
    try:
        model, info = load_for_rank(settings, runtime.group, progress)
    except ModelLoadError as exc:
        die(EXIT_BAD_MODEL, f"cannot load the model: {exc}")
    if cpu_layer.applies():  # Linux x86_64, MLX on its CPU device: the CPU layer's gate
        log.info("matrix products: %s", cpu_layer.in_use() or "MLX's own BLAS (no OpenBLAS here)")
        swapped = transpose_linears(model, settings.linear_layout)
        log.info(
            "linear layers: %d stored [in, out] (LINEAR_LAYOUT=%s)", swapped, settings.linear_layout
        )
    if head_on_last_position(model):
        log.debug("output head: last position only (engine/last_logits.py)")
    return build_engine(settings, model, info, runtime)


def _status(settings: Settings, runtime: RankRuntime, loaded: LoadedRank) -> RankStatus:
    """This rank's report to rank 0: its share, memory, prefix-cache budget and the memory
    its runtime holds beyond them."""
    info = loaded.info
    share = info.plan.ranks[runtime.ident.rank]
    chunk, dtype = settings.prefill_chunk_size, activation_bytes(info.path, info.config)
    return RankStatus(
        rank=runtime.ident.rank,
        host=runtime.ident.host,
        share=info.share,
        weight_bytes=info.weight_bytes,
        memory_bytes=mx.get_active_memory(),
        machine_memory_bytes=info.host.memory_bytes,
        kv_bytes_per_token=loaded.kv_bytes_per_token,
        prefix_cache_bytes=prefix_budget(
            settings.prefix_cache_bytes,
            info.host.memory_bytes,
            info.ranks_on_host,
            info.weight_bytes,
        ),
        overhead_bytes=overhead(info.plan.shape, share, chunk, dtype).total,
    )


def _progress_reporter(
    wake: WakeSender | WakeReceiver | None, booted: Boot | None
) -> Callable[[int, int], None]:
    """Where this rank reports its load progress: to rank 0, or rank 0's own status."""
    if isinstance(wake, WakeReceiver):
        return wake.send_progress
    assert booted is not None
    return lambda done, total: booted.booting.on_progress(0, done, total)


if __name__ == "__main__":
    _detach_stdin()
    sys.exit(run_with_settings(main))
