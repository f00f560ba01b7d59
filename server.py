"""Entry for every rank: group setup, model load, the lock-step step loop.

Rank 0 owns the socket, tokenizer, scheduler and sampler (engine/leader.py); it
broadcasts one step plan per step and every rank applies it and runs the forward pass.
Idle ranks block on the wake channel (no spinning); SIGTERM or a shutdown message ends
every rank with exit 0.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_tokenizer

from config.logging_setup import setup_logging
from config.settings import Settings, run_with_settings
from distributed.broadcast import Broadcaster
from distributed.group import GroupJoinError, init_group, leader_address
from distributed.loader import ModelInfo, ModelLoadError, install_eval_guard, load_for_rank
from distributed.memory import KV_GROUP_SIZE, prefix_budget
from distributed.profile import CollectiveProfiler
from distributed.wake import WakeError, WakeReceiver, WakeSender, open_wake_channel
from distributed.watchdog import CollectiveWatchdog
from engine import cpu_attention
from engine.batch_engine import BatchEngine, PlanMismatchError
from engine.compiled_decode import CompiledDecode
from engine.constraints import GrammarTokens
from engine.context_window import choose_context
from engine.cpu_linear import transpose_linears
from engine.draft_model import DraftError, DraftModel, load_draft
from engine.last_logits import head_on_last_position
from engine.leader import EXIT_PEER_GONE, Booting, Leader, die
from engine.prefill_budget import PrefillBudget
from engine.prefix_cache import PrefixCache
from engine.prefix_disk import DiskTier, layout_digest
from engine.prefix_disk_index import DiskIndex
from engine.prefix_store import PrefixStore, budget_tokens, kv_bytes_per_token
from engine.quantized_kv import agreed_bits
from engine.sampling_defaults import SamplingDefaults
from engine.scheduler import Scheduler
from engine.speculation import Speculator, rollback_refusal
from engine.step_plan import PlanDecodeError, StepPlan
from ipc.server import Event, SocketServer
from ipc.status import RankStatus
from launcher import cpu_layer

EXIT_BAD_MODEL = 2
EXIT_DIVERGED = 4
log = logging.getLogger("ring")


def _detach_stdin() -> None:
    """Close the pipe mlx.launch relays stdin into (it busy-loops while that stays open)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _worker_loop(engine: BatchEngine, broadcaster: Broadcaster, wake: WakeReceiver) -> None:
    while True:
        try:
            wake.wait()
            log.debug("woken at %.6f", time.time())
        except WakeError as exc:
            die(EXIT_PEER_GONE, f"{exc}; this rank exits")
        while True:
            try:
                plan = StepPlan.decode(broadcaster.broadcast(None))
                engine.check(plan)
                if plan.stop:
                    log.info("stop plan received; exiting")
                    return
                engine.apply(plan)
            except (PlanDecodeError, PlanMismatchError) as exc:
                die(EXIT_DIVERGED, f"stopping the job: {exc}")
            if plan.sleep:
                engine.advance_idle()
                break
            engine.run()


def _progress_reporter(
    wake: WakeSender | WakeReceiver | None, booting: Booting
) -> Callable[[int, int], None]:
    """Where this rank reports its load progress: rank 0's own status, or to rank 0."""
    if isinstance(wake, WakeReceiver):
        return wake.send_progress
    return lambda done, total: booting.on_progress(0, done, total)


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


def _speculator(
    settings: Settings, model: Callable[..., mx.array], info: ModelInfo, tokenizer: object
) -> Speculator:
    """Rank 0's prompt lookup (SPECULATIVE, SPEC_TOKENS) and draft model (DRAFT_MODEL),
    off with the reason where the caches cannot roll back a rejected proposal."""
    if settings.speculative == "off":
        log.info("speculation: off (SPECULATIVE=off)")
        return Speculator(0)
    rule = settings.speculative == "auto"
    refusal = rollback_refusal(make_prompt_cache(model), info.plan.shape.sliding_layers)
    if refusal is not None:
        log.warning("speculation: off for this model: %s", refusal)
        return Speculator(settings.spec_tokens, refusal, rule=rule)
    draft, why = _draft(settings, info, tokenizer)
    log.info(
        "speculation: prompt lookup%s, up to %d tokens a row (SPECULATIVE=%s)",
        f", else draft model {draft.name}" if draft is not None else "",
        settings.spec_tokens,
        settings.speculative,
    )
    return Speculator(settings.spec_tokens, None, rule=rule, draft=draft, draft_reason=why)


def _draft(settings: Settings, info: ModelInfo, tokenizer: object) -> tuple[DraftModel | None, str]:
    """DRAFT_MODEL on rank 0 (None: unset or refused, with the reason: the server then
    serves with prompt lookup alone; engine/draft_model.py)."""
    if not settings.draft_model.strip():
        return None, ""
    started = time.perf_counter()
    vocab = info.config.get("vocab_size") or len(tokenizer)  # type: ignore[arg-type]
    try:
        draft = load_draft(settings, tokenizer, vocab, info.model_id)
    except DraftError as exc:
        log.warning("draft model refused: %s. Speculation uses prompt lookup alone", exc)
        return None, str(exc)
    log.info(
        "draft model: %s on rank 0, %.1f MiB of weights, loaded in %.1f s; %.1f ms a proposal",
        draft.name,
        draft.weight_bytes / 2**20,
        time.perf_counter() - started,
        draft.token_ms,
    )
    return draft, ""


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

    layout = layout_digest(info.path.name, info.config, info.plan.model_dump(), kv_bits)
    return DiskTier.open(root, layout, group.rank(), vote)


def _disk_index(
    settings: Settings, store: PrefixStore, ranks: list[RankStatus]
) -> DiskIndex | None:
    """Rank 0's index of the entries on disk: PREFIX_CACHE_DISK_BYTES in the tokens of the
    rank that keeps the most bytes a token."""
    widest = max(r.kv_bytes_per_token for r in ranks)
    if store.disk is None or store.disk.broken or widest <= 0:
        return None
    index = DiskIndex(store.disk.directory, settings.prefix_disk[1] // widest)
    log.info("prefix cache on disk: %s, %d tokens", store.disk.directory, index.budget_tokens)
    return index


def _peer_lost(exc: RuntimeError) -> bool:
    """MLX's distributed backends report a lost peer as a RuntimeError named `[backend] ...`
    (e.g. `[ring] connection to a peer was lost`) from inside a collective."""
    return str(exc).startswith("[") or "peer" in str(exc)


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
    if cpu_attention.install():
        log.debug("attention: grouped-query kernel for MLX's CPU backend (engine/cpu_attention.py)")
    watchdog = CollectiveWatchdog(settings.collective_timeout_seconds)
    broadcaster = Broadcaster(group, watchdog)
    # Every rank installs it, so the sync points it adds match across ranks.
    profiler = CollectiveProfiler().install() if settings.ring_profile_collectives else None
    events: queue.Queue[Event] = queue.Queue()
    booting = Booting(settings, ident)
    socket = SocketServer(settings.socket_path, events, booting) if ident.is_leader else None
    if socket is not None:
        socket.start()

        def on_signal(signum: int, _frame: object) -> None:
            """SIGTERM/SIGINT: while loading, leave at once; later, stop every rank cleanly."""
            if socket.reporter is booting:
                socket.close()
                name = signal.Signals(signum).name
                die(0, f"{name} while loading the model; exiting", logging.INFO)
            events.put(Event("shutdown"))

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    else:
        # Ctrl-C reaches every rank of a terminal's job; rank 0 alone decides when to stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        wake = open_wake_channel(broadcaster, leader_address())
        if isinstance(wake, WakeSender):
            ready_reports = wake.collect_ready_in_background(booting.on_progress)
        progress = _progress_reporter(wake, booting)
        model, info = load_for_rank(settings, group, progress)
    except WakeError as exc:
        die(EXIT_PEER_GONE, str(exc))
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
    with watchdog.guard("KV size probe (one-token forward)"):
        kv_bits, refused = agreed_bits(model, settings.kv_bits, group)
        per_token = kv_bytes_per_token(model, group, kv_bits)
    if refused:
        log.warning("KV cache: float, not %s bits: %s", settings.kv_bits, refused)
    elif kv_bits:
        log.info("KV cache: %d bits in groups of %d (KV_CACHE_BITS)", kv_bits, KV_GROUP_SIZE)
    # After the probe: the guard does not nest, and the probe holds one around its forward.
    evaluating_parts = install_eval_guard(model, watchdog.guard)
    compiled = _compiled_decode(settings, model, evaluating_parts, profiler is not None)
    store = PrefixStore(kv_bits, _disk_tier(settings, info, kv_bits, group, watchdog))
    engine = BatchEngine(model, settings.prefill_chunk_size, watchdog.guard, compiled, store)
    budget = prefix_budget(
        settings.prefix_cache_bytes, info.host.memory_bytes, info.ranks_on_host, info.weight_bytes
    )
    mine = RankStatus(
        rank=ident.rank,
        host=ident.host,
        share=info.share,
        weight_bytes=info.weight_bytes,
        memory_bytes=mx.get_active_memory(),
        machine_memory_bytes=info.host.memory_bytes,
        kv_bytes_per_token=per_token,
        prefix_cache_bytes=budget,
    )
    if socket is None:
        assert isinstance(wake, WakeReceiver)
        wake.send_ready(mine.model_dump())
        log.info("ready; waiting for work")
        try:
            _worker_loop(engine, broadcaster, wake)
        except RuntimeError as exc:
            if not _peer_lost(exc):
                raise
            die(
                EXIT_PEER_GONE, f"a collective failed ({exc}): a peer rank is gone; this rank exits"
            )
        return 0
    assert wake is None or isinstance(wake, WakeSender)
    tokenizer = load_tokenizer(info.path)
    try:
        reports = ready_reports() if wake is not None else []
    except WakeError as exc:
        die(EXIT_PEER_GONE, str(exc))
    ranks = [mine] + [RankStatus.model_validate(report) for report in reports]
    prefix = PrefixCache(
        budget_tokens([(r.prefix_cache_bytes, r.kv_bytes_per_token) for r in ranks]),
        disk=_disk_index(settings, store, ranks),
    )
    log.info(
        "prefix cache: %s",
        f"{prefix.index.budget_tokens} tokens per rank" if prefix.enabled else "off",
    )
    speculator = _speculator(settings, model, info, tokenizer)
    draft = speculator.draft
    context = choose_context(
        settings.max_sequence_length,
        info.config,
        ranks,
        settings.max_batch_size,
        (draft.weight_bytes, draft.kv_bytes_per_token) if draft else (0, 0),
    )
    log.info("context: %s", context.why)
    defaults = SamplingDefaults.load(info.path, settings)
    vocab_size = info.config.get("vocab_size")  # the embedding's rows
    log.info("sampling defaults: %s", defaults.describe())
    scheduler = Scheduler(
        tokenizer,
        settings.max_batch_size,
        context.tokens,
        prefix,
        grammar=GrammarTokens.build(
            tokenizer, vocab_size or len(tokenizer), tokenizer.eos_token_ids
        ),
        defaults=defaults,
        vocab_size=vocab_size,
        speculator=speculator,
        prefill_budget=PrefillBudget(settings.prefill_chunk_size, settings.prefill_slowdown)
        if settings.prefill_slowdown
        else None,
    )
    log.info("chat prompt: %s", scheduler.setup.chat.describe())
    leader = Leader(
        settings=settings,
        ident=ident,
        socket=socket,
        events=events,
        info=info,
        ranks=ranks,
        scheduler=scheduler,
        engine=engine,
        broadcaster=broadcaster,
        wake=wake,
        profiler=profiler,
        started=booting.started,
    )
    if wake is not None:
        wake.watch(leader.rank_lost)
    socket.reporter = leader
    log.info(
        "ready: %s on %d rank(s); socket %s", info.model_id, ident.world_size, settings.socket_path
    )
    try:
        leader.run()
    except RuntimeError as exc:
        if not _peer_lost(exc):
            raise
        die(EXIT_PEER_GONE, f"a collective failed ({exc}): a worker rank is gone; stopping")
    socket.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    _detach_stdin()
    sys.exit(run_with_settings(main))
