"""Every registered family split for real (mlx.launch, ring backend, 127.0.0.1) against one rank.

Tiny random models of each family (float32 and 4-bit; mxfp4 for gpt_oss, also in the
layout its Hugging Face checkpoints ship: mxfp4 expert blocks, the rest float) run through
tests/support/logits_probe.py: one reference process, one 2-rank launch (auto, which is
tensor + expert parallel, and pipeline; the families split by mlx-lm's shard(): even tensor,
and pipeline where they have one, mlx-lm's or our stage's) and one 3-rank launch (tensor +
expert parallel with weights 2,1,1, for the quantized models and the float32 MoE; the
float32 models of the mlx-lm pipeline() families, four layers each, as 2,1,1 pipelines).
Each case must give rank 0 the reference's logits (1e-4 float32, 1e-3 quantized) and the
same greedy tokens (32 at 2 ranks, 8 at 3); a request decoded in a batch must equal it
decoded alone; every rank's weight bytes and KV bytes per token must equal what the
planner predicted from the headers; the tiny MoE's ranks must hold their weighted share.
Then the real server on an MoE family and on mlx-lm's pipeline().
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from distributed.families import registered
from launcher.local_cluster import Cluster
from tests.support.family_configs import CONFIGS, MLX_LM_CONFIGS, PLAIN_KV
from tests.support.probe_runner import Case, run_probe
from tests.support.rank_requests import greedy, run_requests
from tests.support.tiny_families import write_family_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FLOAT_TOLERANCE = 1e-4
QUANT_TOLERANCE = 1e-3  # same quantized weights on every rank: only the summation order differs
SHARE_LIMIT = 1.05  # a rank's weight bytes against its weighted share of the whole model
PROMPT = [60, 124, 105, 109, 95, 115, 116, 97, 114, 116, 124, 62, 117, 115, 101, 114, 10, 72]

MODELS: dict[str, tuple[str, int | None, str]] = {
    f"{family}_{tag}": (family, bits, "affine")
    for family in CONFIGS
    for tag, bits in (("f32", None), ("q4", 4))
}
MODELS["gpt_oss_mxfp4"] = ("gpt_oss", 4, "mxfp4")
MODELS["gpt_oss_hf_mxfp4"] = ("gpt_oss", 4, "hf-mxfp4")  # as gpt-oss ships: only experts mxfp4
MODELS |= {
    f"{family}_{tag}": (family, bits, "affine")
    for family in MLX_LM_CONFIGS
    for tag, bits in (("f32", None), ("q4", 4))
}


def _family(case: Case) -> str:
    return MODELS[case.model][0]


def _mlx_lm_cases(model: str, family: str) -> tuple[Case, ...]:
    cases = (Case(model, 2, "tensor", None, "tensor-even"),)
    if family in PIPELINED:
        cases += (Case(model, 2, "pipeline", None, "pipeline"),)
    if family in MLX_LM_PIPELINED and model.endswith("_f32"):  # their tiny models: 4 layers
        cases += (Case(model, 3, "pipeline", [2, 1, 1], "pipeline"),)
    return cases


def _uneven(model: str) -> bool:
    """Which models split 2,1,1 over 3 ranks: the quantized ones (their slices must keep
    whole groups of scales, the harder case; float32 slices are the same code), and the
    float32 MoE whose weight share is checked. 3 ranks share this host's 2 cores, so
    each case costs several seconds (the float32 ones were 30 s of the suite)."""
    return not model.endswith("_f32") or model == "qwen3_moe_f32"


PIPELINED = {f for f in MLX_LM_CONFIGS if "pipeline" in getattr(registered(f), "splits", ())}
MLX_LM_PIPELINED = {f for f in MLX_LM_CONFIGS if getattr(registered(f), "mlx_lm_pipeline", False)}
CASES = [
    case
    for model, (family, _, _) in MODELS.items()
    for case in (
        _mlx_lm_cases(model, family)
        if family in MLX_LM_CONFIGS
        else (
            Case(model, 2, "auto", None, "tensor-even"),
            Case(model, 2, "pipeline", None, "pipeline"),
            *((Case(model, 3, "tensor", [2, 1, 1], "tensor-uneven"),) if _uneven(model) else ()),
        )
    )
]


def _spec(cases: list[dict], models: dict[str, Path]) -> dict:
    for case in cases:
        case["model"] = str(models[case["model"]])
    return {"prompt": PROMPT, "steps": 32, "batch_steps": 4, "cases": cases}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("families")
    models = {
        name: write_family_model(root / name, family, bits=bits, mode=mode)
        for name, (family, bits, mode) in MODELS.items()
    }
    outputs = {n: root / f"ranks{n}" for n in (1, 2, 3)}
    run_probe(_spec([{"name": f"ref_{m}", "model": m} for m in models], models), outputs[1], 1, 300)
    for ranks in (2, 3):
        cases = [c.spec() for c in CASES if c.ranks == ranks]
        run_probe(_spec(cases, models), outputs[ranks], ranks, 600)
    return outputs


def _infos(results: dict[int, Path], case: Case) -> list[dict]:
    out = results[case.ranks]
    return [json.loads((out / f"{case.name}.rank{r}.json").read_text()) for r in range(case.ranks)]


def _reference(results: dict[int, Path], model: str) -> tuple[np.lib.npyio.NpzFile, dict]:
    info = json.loads((results[1] / f"ref_{model}.rank0.json").read_text())
    return np.load(results[1] / f"ref_{model}.npz"), info


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_split_family_matches_one_rank(results: dict[int, Path], case: Case) -> None:
    infos = _infos(results, case)
    assert {info["strategy"] for info in infos} == {case.strategy}, infos[0]["plan"]
    got = np.load(results[case.ranks] / f"{case.name}.npz")
    want, _ = _reference(results, case.model)
    steps = case.steps  # the reference decoded 32: the case's first tokens must equal its
    assert got["tokens"].tolist() == want["tokens"][:steps].tolist(), "greedy tokens differ"
    tolerance = QUANT_TOLERANCE if case.quantized else FLOAT_TOLERANCE
    for key in ("prompt_logits", "step_logits", "padded_logits", "batch_logits"):
        reference = want[key][:steps] if key == "step_logits" else want[key]
        assert _diff(got[key], reference) <= tolerance, f"{key} differs"
    # The full prompt decoded in a batch beside a shorter one equals it decoded alone.
    batch_steps = got["batch_logits"].shape[0]
    alone = got["step_logits"][:batch_steps]
    assert _diff(got["batch_logits"][:, 0], alone) <= tolerance, "batched != alone"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_memory_matches_the_prediction_from_the_headers(
    results: dict[int, Path], case: Case
) -> None:
    for rank, info in enumerate(_infos(results, case)):
        assert info["weight_bytes"] == info["predicted_weight_bytes"], (case.name, rank)
        if _family(case) in PLAIN_KV:
            assert info["kv_bytes_per_token"] == info["predicted_kv_bytes_per_token"] > 0
        else:
            assert info["kv_bytes_per_token"] == 0  # prefix cache off on every rank


@pytest.mark.parametrize("model", ["qwen3_moe_f32", "qwen3_moe_q4"])
def test_tiny_moe_ranks_hold_their_weighted_share(results: dict[int, Path], model: str) -> None:
    case = next(c for c in CASES if c.model == model and c.ranks == 3)
    _, reference = _reference(results, model)
    single = reference["weight_bytes"]
    held = [info["weight_bytes"] for info in _infos(results, case)]
    weights = case.weights or []
    for count, weight in zip(held, weights, strict=True):
        share = single * weight / sum(weights)
        assert count <= SHARE_LIMIT * share, (held, single)


# ---- the real server on an MoE family and on mlx-lm's pipeline() -------------------------

SERVER_ENV = {
    "MAX_BATCH_SIZE": "4",
    "PREFILL_CHUNK_SIZE": "16",
    # room for the cancelled answer below to outlast a slow client: its 400 tokens took
    # 3.5 s here, and once (CI, a busy host) ended before the cancel landed
    "MAX_SEQUENCE_LENGTH": "4096",
    "DEFAULT_MAX_TOKENS": "64",
    "PARALLELISM": "tensor",  # experts and heads split (auto may pick a pipeline by speed)
}


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory):
    """2 ranks of server.py serving the tiny deepseek_v2 (MLA by heads, experts, shared
    experts, a dense first layer), whose special tokens never win (answers run to max)."""
    directory = write_family_model(tmp_path_factory.mktemp("dsv2") / "model", "deepseek_v2")
    path = directory / "model.safetensors"
    weights = mx.load(str(path))
    weights["lm_head.weight"][256:] = 0.0
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    with Cluster(directory, ranks=2, env=SERVER_ENV) as running:
        yield running


def test_the_server_batches_cancels_and_caches_prefixes_on_an_moe_family(moe_server) -> None:
    plan = moe_server.status().plan
    assert plan["split_experts"] and plan["split_heads"] and plan["split_vocab"]
    _batches_cancels_and_caches(moe_server)
    # rank 0 counted the routes: the busiest rank's share, at least an even split's
    assert 0.5 <= moe_server.status().step_model.expert_load <= 1.0


@pytest.fixture(scope="module")
def mlx_lm_pipeline_server(tmp_path_factory: pytest.TempPathFactory):
    """2 ranks of server.py serving the tiny ministral3 through mlx-lm's own pipeline()."""
    directory = write_family_model(tmp_path_factory.mktemp("ministral3") / "model", "ministral3")
    env = {**SERVER_ENV, "PARALLELISM": "pipeline"}
    with Cluster(directory, ranks=2, env=env) as running:
        yield running


def test_the_server_runs_a_family_through_mlx_lms_pipeline(mlx_lm_pipeline_server) -> None:
    plan = mlx_lm_pipeline_server.status().plan
    assert plan["strategy"] == "pipeline" and plan["via_mlx_lm"]
    _batches_cancels_and_caches(mlx_lm_pipeline_server)


def _batches_cancels_and_caches(server: Cluster) -> None:
    """A request alone, then again in a batch beside a shorter one and a cancelled one: the
    same greedy tokens both times, the second time from the prefix cache."""
    prompt = "Tell me about the rings of Saturn and their moons. " * 2
    with server.client(timeout=120) as client:
        _, alone, _ = run_requests(client, [greedy("alone", prompt, 16)])
        # "c" asks for logprobs, so each of its tokens arrives at once (random bytes of a
        # tiny model can be withheld as incomplete text) and the cancel lands mid-answer.
        cancelled = greedy("c", "x" * 40, 4000, logprobs=True)
        batch = [greedy("a", prompt, 16), greedy("b", "Short one", 24), cancelled]
        _, tokens, final = run_requests(client, batch, cancel_after={"c": 3})
    assert tokens["a"] == alone["alone"], "a request decoded in a batch differs from alone"
    assert [final[i].finish_reason for i in "abc"] == ["length", "length", "cancelled"]
    assert 3 <= len(tokens["c"]) < 4000
    assert final["a"].usage.prompt_tokens_details.cached_tokens > 0  # its KV reused
