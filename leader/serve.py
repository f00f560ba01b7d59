"""Rank 0's whole service once its model is loaded: the tokenizer, every rank's ready
report, the prefix cache's policy, speculation, the context, the sampling defaults and the
scheduler, composed into the Leader, which runs the step loop until told to stop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from config.settings import Settings
from distributed.exits import EXIT_PEER_GONE, die, peer_lost
from distributed.expert_load import ExpertLoad
from distributed.loader import ModelInfo, install_expert_load
from distributed.memory import element_bytes, kv_bytes
from distributed.runtime import RankRuntime
from distributed.step_model import ClusterModel
from distributed.step_work import plan_work
from distributed.wake import WakeError, WakeSender
from engine.build import LoadedRank
from engine.prefix_store import PrefixStore, budget_tokens
from ipc.status import RankStatus
from leader.booting import Boot
from leader.constraints import GrammarTokens
from leader.context_window import choose_context
from leader.draft_model import DraftError, DraftModel, load_draft
from leader.loop import Leader
from leader.prefill_budget import PrefillBudget
from leader.prefix_cache import PrefixCache
from leader.prefix_disk_index import DiskIndex
from leader.requests import Requests
from leader.sampling_defaults import SamplingDefaults
from leader.scheduler import Scheduler
from leader.spec_rule import StepCosts
from leader.speculation import Speculator, rollback_refusal
from leader.step_times import StepTimes
from leader.warmup import WarmUp

log = logging.getLogger("ring")


def serve_leader(
    settings: Settings,
    runtime: RankRuntime,
    boot: Boot,
    loaded: LoadedRank,
    mine: RankStatus,
    wake: WakeSender | None,
    ready_reports: Callable[[], list[dict[str, Any]]],
) -> int:
    """Compose rank 0's side over its engine (`mine`: its own status; `ready_reports`: the
    workers', waited for here) and run it; the exit status."""
    info, ident = loaded.info, runtime.ident
    tokenizer = load_tokenizer(info.path)
    try:
        reports = ready_reports()
    except WakeError as exc:
        die(EXIT_PEER_GONE, str(exc))
    ranks = [mine] + [RankStatus.model_validate(report) for report in reports]
    model = _step_model(settings, info, ranks)
    scheduler = _scheduler(settings, loaded, ranks, tokenizer, model)
    leader = Leader(
        settings,
        runtime,
        boot,
        loaded,
        ranks,
        scheduler,
        wake,
        warm_up=_warm_up(settings, scheduler),
        step_times=StepTimes(model, _expert_load(loaded)),
    )
    if wake is not None:
        wake.watch(leader.rank_lost)
    boot.socket.reporter = leader
    log.info(
        "loaded: %s on %d rank(s); socket %s%s",
        info.model_id,
        ident.world_size,
        settings.socket_path,
        "; warming up before ready" if leader.warm_up is not None else "",
    )
    try:
        leader.run()
    except RuntimeError as exc:
        if not peer_lost(exc):
            raise
        die(EXIT_PEER_GONE, f"a collective failed ({exc}): a worker rank is gone; stopping")
    boot.socket.close()
    log.info("stopped")
    return 0


def _step_model(settings: Settings, info: ModelInfo, ranks: list[RankStatus]) -> ClusterModel:
    """The step-time model of this cluster: the plan's work, scaled to the weights each rank
    loaded, on the machines and link measured at start."""
    bits = None if info.plan.shape.sliding_layers else settings.kv_bits
    per_token = kv_bytes(info.plan, element_bytes(info.activation_bytes, bits))
    work = plan_work(info.plan, info.activation_bytes, [float(t) for t, _ in per_token])
    model = ClusterModel(work.calibrated([r.weight_bytes for r in ranks]), info.speed)
    log.info(
        "step-time model: a decode step %.1f ms at 1 row, %.1f at 8; prefill %.0f tokens/s",
        model.decode_ms(1),
        model.decode_ms(8),
        512_000 / model.prefill_ms(512),
    )
    return model


def _expert_load(loaded: LoadedRank) -> ExpertLoad | None:
    """Where the experts are split, a count of their routes for the step-time model."""
    load = ExpertLoad(loaded.info.plan.shape.num_experts)
    if not install_expert_load(loaded.model, load):
        return None
    log.info("expert split: rank 0 counts each MoE layer's routes (the step-time model's load)")
    return load


def _scheduler(
    settings: Settings,
    loaded: LoadedRank,
    ranks: list[RankStatus],
    tokenizer: TokenizerWrapper,
    step_model: ClusterModel,
) -> Scheduler:
    """The scheduler and every policy it holds, each logged as it is decided; the rules'
    costs start from `step_model`'s predictions."""
    model, info = loaded.model, loaded.info
    prefix = PrefixCache(
        budget_tokens([(r.prefix_cache_bytes, r.kv_bytes_per_token) for r in ranks]),
        disk=_disk_index(settings, loaded.engine.prefix, ranks),
    )
    log.info(
        "prefix cache: %s",
        f"{prefix.index.budget_tokens} tokens per rank" if prefix.enabled else "off",
    )
    speculator = _speculator(settings, model, info, tokenizer)
    speculator.costs = StepCosts(prior=step_model.decode_ms)
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
    grammar = GrammarTokens.build(tokenizer, vocab_size or len(tokenizer), tokenizer.eos_token_ids)
    requests = Requests(tokenizer, context.tokens, prefix, grammar, defaults, vocab_size)
    scheduler = Scheduler(
        requests,
        settings.max_batch_size,
        speculator=speculator,
        prefill_budget=PrefillBudget(
            settings.prefill_chunk_size,
            settings.prefill_slowdown,
            prior=step_model.prefill_coefficients(),
        )
        if settings.prefill_slowdown
        else None,
    )
    log.info("chat prompt: %s", scheduler.requests.setup.chat.describe())
    return scheduler


def _warm_up(settings: Settings, scheduler: Scheduler) -> WarmUp | None:
    """The warm-up before ready (WARM_UP=auto): widths up to 1 + SPEC_TOKENS where
    speculation runs."""
    if settings.warm_up == "off":
        log.info("warm-up: off (WARM_UP=off): the first requests compile and trace")
        return None
    speculator = scheduler.speculator
    widest = 1 + speculator.tokens if speculator.enabled else 1
    return WarmUp(widest, settings.max_batch_size, scheduler.requests.max_sequence_length)


def _speculator(
    settings: Settings,
    model: Callable[..., mx.array],
    info: ModelInfo,
    tokenizer: TokenizerWrapper,
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


def _draft(
    settings: Settings, info: ModelInfo, tokenizer: TokenizerWrapper
) -> tuple[DraftModel | None, str]:
    """DRAFT_MODEL on rank 0 (None: unset or refused, with the reason: the server then
    serves with prompt lookup alone; leader/draft_model.py)."""
    if not settings.draft_model.strip():
        return None, ""
    started = time.perf_counter()
    vocab = info.config.get("vocab_size") or len(tokenizer)
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
