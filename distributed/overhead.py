"""Memory a rank holds beyond its weights, KV cache and prefix cache, as the plan
(distributed/memory.py, `./launch.sh plan`) and rank 0's context choice
(leader/context_window.py) count it:

- the compiled decode's traces: at most MAX_TRACES (engine/compiled_decode.py keeps the
  most recently used), each about TRACE_BYTES_PER_LAYER for every layer the rank computes
  (the default model, 30 layers: 100 traces held 268 MB of the C heap, 2.7 MB each);
- MLX's buffer cache: freed buffers MLX keeps for reuse, which every rank bounds to
  BUFFER_CACHE_BYTES at start (`limit_buffer_cache`; MLX's CPU backend keeps 32 MiB by
  itself, Metal as much as its memory limit);
- a step's working buffers: the activations of one prefill chunk (PREFILL_CHUNK_SIZE
  tokens: the hidden states, queries, keys, values and the MLP's columns this rank holds)
  and a block of attention scores (engine/cpu_attention.py bounds them to SCORE_BLOCK).

The figures: docs/RELIABILITY.md, "Agent soak: memory under agent traffic".
"""

from __future__ import annotations

from dataclasses import dataclass

from distributed.model_shape import ModelShape
from distributed.plan import RankShare

MAX_TRACES = 64
TRACE_BYTES_PER_LAYER = 96 * 2**10
BUFFER_CACHE_BYTES = 128 * 2**20
SCORE_BLOCK = 1 << 20  # attention scores one block of query rows holds (float32)
SCORE_COPIES = 3  # the scores, their exponentials and the weights, alive at once


@dataclass(frozen=True)
class Overhead:
    """One rank's memory beyond weights, KV and prefix cache, in bytes."""

    traces: int
    buffer_cache: int
    step_buffers: int

    @property
    def total(self) -> int:
        return self.traces + self.buffer_cache + self.step_buffers

    def describe(self) -> str:
        mib = 2**20
        return (
            f"{self.total / mib:.0f} MiB (decode traces {self.traces / mib:.0f}, MLX buffer "
            f"cache {self.buffer_cache / mib:.0f}, a prefill chunk's buffers "
            f"{self.step_buffers / mib:.0f})"
        )


def overhead(shape: ModelShape, share: RankShare, chunk: int, activation_bytes: int) -> Overhead:
    """The overhead of the rank holding `share`, prefilling `chunk` tokens a step."""
    layers = share.layers[1] - share.layers[0]
    columns = share.mlp_columns[1] - share.mlp_columns[0]
    if shape.num_experts:  # the routed experts a token runs, as wide as they are
        columns = max(columns, shape.experts_per_token * shape.expert_size + shape.shared_size)
    heads = share.q_heads[1] - share.q_heads[0] or shape.num_heads
    kv_heads = share.kv_heads[1] - share.kv_heads[0] or shape.num_kv_heads
    attention = (heads + 2 * kv_heads) * shape.head_dim
    per_token = 3 * shape.hidden_size + attention + 3 * columns
    step = chunk * per_token * activation_bytes if layers else 0
    step += SCORE_COPIES * SCORE_BLOCK * 4 if layers else 0
    return Overhead(
        traces=MAX_TRACES * TRACE_BYTES_PER_LAYER * layers,
        buffer_cache=BUFFER_CACHE_BYTES,
        step_buffers=step,
    )
