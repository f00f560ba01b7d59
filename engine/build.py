"""Every rank's batch engine, built over its loaded share of the model: the KV cache's bits
as every rank agrees on them (a one-token probe, also measuring this rank's KV bytes a
token), the collective watchdog inside the forward, the compiled decode step where it
applies, and this rank's part of the prefix cache (in memory, and on disk with
PREFIX_CACHE_DIR). Every rank calls `build_engine` together: the probes hold collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from config.settings import Settings
from distributed.loader import ModelInfo, install_eval_guard
from distributed.memory import KV_GROUP_SIZE
from distributed.runtime import RankRuntime
from distributed.watchdog import CollectiveWatchdog
from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode
from engine.prefix_disk import DiskTier, layout_digest
from engine.prefix_store import PrefixStore, kv_bytes_per_token
from engine.quantized_kv import agreed_bits

log = logging.getLogger("ring")


@dataclass(frozen=True)
class LoadedRank:
    """This rank's share of the model and the engine over it."""

    model: Callable[..., mx.array]
    info: ModelInfo
    engine: BatchEngine
    kv_bytes_per_token: int  # this rank's; 0: no prefix cache (caches it cannot slice)


def build_engine(
    settings: Settings, model: Callable[..., mx.array], info: ModelInfo, runtime: RankRuntime
) -> LoadedRank:
    """This rank's engine over its loaded share."""
    group, watchdog = runtime.group, runtime.watchdog
    with watchdog.guard("KV size probe (one-token forward)"):
        kv_bits, refused = agreed_bits(model, settings.kv_bits, group)
        per_token = kv_bytes_per_token(model, group, kv_bits)
    if refused:
        log.warning("KV cache: float, not %s bits: %s", settings.kv_bits, refused)
    elif kv_bits:
        log.info("KV cache: %d bits in groups of %d (KV_CACHE_BITS)", kv_bits, KV_GROUP_SIZE)
    # After the probe: the guard does not nest, and the probe holds one around its forward.
    evaluating_parts = install_eval_guard(model, watchdog.guard)
    compiled = _compiled_decode(settings, model, evaluating_parts, runtime.profiler is not None)
    store = PrefixStore(kv_bits, _disk_tier(settings, info, kv_bits, group, watchdog))
    engine = BatchEngine(model, settings.prefill_chunk_size, watchdog.guard, compiled, store)
    return LoadedRank(model, info, engine, per_token)


def _compiled_decode(
    settings: Settings, model: Callable[..., mx.array], evaluating_parts: int, profiling: bool
) -> CompiledDecode | None:
    """The compiled decode step, where it can apply: not where parts of the forward
    evaluate (pipeline stages, expert routing) or the collective profiler times all_sums."""
    if settings.compiled_decode == "off":
        log.info("decode: eager (COMPILED_DECODE=off)")
        return None
    if evaluating_parts or profiling:
        why = "the forward evaluates inside" if evaluating_parts else "collectives are profiled"
        log.info("decode: eager (%s)", why)
        return None
    log.info("decode: compiled where the caches allow (COMPILED_DECODE=auto)")
    return CompiledDecode(model)


def _disk_tier(
    settings: Settings,
    info: ModelInfo,
    kv_bits: int | None,
    group: mx.distributed.Group,
    watchdog: CollectiveWatchdog,
) -> DiskTier | None:
    """This rank's part of the prefix cache on disk (PREFIX_CACHE_DIR), in a directory
    named by the model, its split and the KV bits; None with PREFIX_CACHE_DISK_BYTES=0."""
    root, size = settings.prefix_disk
    if not size:
        return None

    def vote(failed: list[int]) -> list[int]:
        if group.size() == 1:
            return failed
        with watchdog.guard("prefix cache disk vote"):
            return np.array(mx.distributed.all_sum(mx.array(failed), group=group)).tolist()

    # the plan's identity, not its dump: auto's note holds the predictions of each start,
    # which gave every start a new directory (142 of them here) and no restart a hit
    layout = layout_digest(info.path.name, info.config, info.plan.identity(), kv_bits)
    return DiskTier.open(root, layout, group.rank(), vote)
