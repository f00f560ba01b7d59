"""Machines, a link and a model shape for the step-time model's tests: a machine whose
rate holds whatever the rows, so a prediction's parts can be worked out by hand."""

from __future__ import annotations

from distributed.chips import Link
from distributed.step_model import Machine
from distributed.step_overhead import Overhead

FREE = Overhead(0.0, 0.0, 0.0, "none")
LINK = Link("test", 100.0, 1.0, "ring", "test")  # 0.1 ms + 1 GB/s
SMOL = {  # SmolLM2-135M's config.json: 9 query / 3 KV heads, 30 layers, tied embeddings
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}  # fmt: skip


def flat(rate: float = 1e7, overhead: Overhead = FREE) -> Machine:
    """A machine that reads `rate` bytes a ms whatever the rows."""
    return Machine("flat", 2**34, 2, rates=((1, rate), (16, rate)), overhead=overhead)
