"""A worker's share, as the first host writes it (launcher/share_source.py) and the worker
loads it (distributed/rank_share.py), holds exactly the arrays the loader's own split gives
that rank from the whole model: same names, shapes, dtypes and bytes, for tensor, expert
and pipeline plans at 2 and 3 ranks, even and uneven, float and quantized, and for families
whose checkpoint mlx-lm reshapes on load (gpt-oss's Hugging Face mxfp4 experts) or splits
itself. A share made for another split, rank or model is refused before anything loads.
One process, no ranks: the split reads only a group's rank and size.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from acquisition.identity import identify
from acquisition.wire import BLOCK_BYTES, block_length, blocks_of
from distributed.plan import Plan, make_plan
from distributed.rank_share import META_FILE, ShareMismatch, load_share, rank_parameters
from distributed.splitting import StandInGroup, parameters
from launcher.share_source import Offer, share_offer
from tests.support.tiny_families import write_family_model
from tests.support.tiny_models import write_tiny_model

# (model, ranks, PARALLELISM, RANK_WEIGHTS, the strategy the plan must choose)
CASES = [
    ("llama", 2, "tensor", None, "tensor-even"),
    ("llama", 3, "tensor", [2, 1, 1], "tensor-uneven"),
    ("llama", 3, "pipeline", None, "pipeline"),
    ("qwen3_moe", 2, "tensor", None, "tensor-even"),
    ("qwen3_moe", 3, "tensor", [2, 1, 1], "tensor-uneven"),
    ("qwen3_moe", 2, "pipeline", None, "pipeline"),
    ("qwen3_moe_q4", 3, "tensor", None, "tensor-uneven"),
    ("deepseek_v3", 3, "tensor", [2, 1, 1], "tensor-uneven"),
    ("gpt_oss_hf", 2, "tensor", None, "tensor-even"),
    ("ministral3", 2, "tensor", None, "tensor-even"),
    ("ministral3", 3, "pipeline", None, "pipeline"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("share-models")
    return {
        "llama": write_tiny_model(
            root / "llama", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3
        ),
        "qwen3_moe": write_family_model(root / "qwen3_moe", "qwen3_moe"),
        "qwen3_moe_q4": write_family_model(root / "qwen3_moe_q4", "qwen3_moe", bits=4),
        "deepseek_v3": write_family_model(root / "deepseek_v3", "deepseek_v3"),
        "gpt_oss_hf": write_family_model(root / "gpt_oss_hf", "gpt_oss", mode="hf-mxfp4"),
        "ministral3": write_family_model(root / "ministral3", "ministral3"),
    }


def _plan(model_dir: Path, ranks: int, parallelism: str, weights: list[float] | None) -> Plan:
    config = json.loads((model_dir / "config.json").read_text())
    return make_plan(config, ranks, weights, parallelism)


def write_offer(offer: Offer, directory: Path) -> int:
    """Every file of the offer, block by block as the sender reads them; the bytes written."""
    directory.mkdir(parents=True)
    written = 0
    for file in offer.files:
        with open(directory / file.name, "wb") as out:
            for block in range(blocks_of(file.size)):
                data = file.read(block * BLOCK_BYTES, block_length(file.size, block))
                assert len(data) == block_length(file.size, block), file.name
                out.write(data)
                written += len(data)
    return written


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}{c[1]}")
def test_a_share_holds_exactly_what_the_loader_gives_the_rank(
    case: tuple, models: dict[str, Path], tmp_path: Path
) -> None:
    name, ranks, parallelism, weights, strategy = case
    model_dir = models[name]
    plan = _plan(model_dir, ranks, parallelism, weights)
    assert plan.strategy == strategy
    identity = identify(model_dir, tmp_path / "cache")
    for rank in range(1, ranks):
        offer = share_offer(model_dir, plan, rank, identity)
        written = write_offer(offer, tmp_path / f"rank{rank}")
        assert written == offer.total_bytes
        loaded = dict(
            parameters(
                load_share(tmp_path / f"rank{rank}", plan, StandInGroup(rank, ranks), identity.key)
            )
        )
        expected = dict(rank_parameters(model_dir, plan, rank))
        assert loaded.keys() == expected.keys()
        for key, array in expected.items():
            assert loaded[key].dtype == array.dtype and loaded[key].shape == array.shape, key
            assert mx.array_equal(loaded[key], array).item(), key
        held = sum(a.nbytes for a in expected.values())
        assert offer.weight_bytes == held
        # headers, config, tokenizer and the layout are the rest
        assert offer.total_bytes - held < 64 * 1024


def test_a_share_for_another_split_or_rank_is_refused_naming_both(
    models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = models["qwen3_moe"]
    even = _plan(model_dir, 3, "tensor", None)
    uneven = _plan(model_dir, 3, "tensor", [2, 1, 1])
    identity = identify(model_dir, tmp_path / "cache")
    write_offer(share_offer(model_dir, even, 1, identity), tmp_path / "share")
    with pytest.raises(ShareMismatch) as refused:
        load_share(tmp_path / "share", uneven, StandInGroup(1, 3), identity.key)
    message = str(refused.value)
    assert "the share was made for rank 1 of this split" in message
    assert "weights 1,1,1" in message and "weights 2,1,1" in message
    with pytest.raises(ShareMismatch, match="made for rank 1 .* planned rank 2"):
        load_share(tmp_path / "share", even, StandInGroup(2, 3), identity.key)
    with pytest.raises(ShareMismatch, match="the cluster serves another-model"):
        load_share(tmp_path / "share", even, StandInGroup(1, 3), "another-model")


def test_a_share_whose_tensors_differ_from_the_plans_is_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = models["llama"]
    plan = _plan(model_dir, 2, "tensor", None)
    identity = identify(model_dir, tmp_path / "cache")
    share = tmp_path / "share"
    write_offer(share_offer(model_dir, plan, 1, identity), share)
    tensors = next(share.glob("share-*.safetensors"))
    arrays = mx.load(str(tensors))
    name = sorted(arrays)[0]
    arrays[name] = arrays[name][:1]  # one row where the plan gives it more
    mx.save_safetensors(str(tensors), arrays)
    with pytest.raises(ShareMismatch, match=f"the share's {name.replace('.', '[.]')} is"):
        load_share(share, plan, StandInGroup(1, 2), identity.key)
    meta = json.loads((share / META_FILE).read_text())
    assert meta["rank"] == 1 and meta["model_key"] == identity.key
