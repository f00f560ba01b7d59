"""What verifying W positions in one decode step costs, on whatever device MLX computes on.

    .venv/bin/python -m bench.verify_width [--shape smollm2-135m|llama-8b] [--dtype bfloat16]
        [--context 1024] [--widths 1 2 3 5 9] [--batch 1]

A speculative step (leader/speculation.py) sends each row's next token and its proposals
through one forward: W positions where a plain step has one. Its worth rests on that
forward costing little more than one position's, which holds where the step is bound by
reading the weights (a GPU, a Mac) and less on a CPU, whose products grow with the rows.
This builds the model from a config with random weights (the times do not depend on the
values), prefills `--context` tokens, then times steps of W positions over that cache
(each trimmed back after), median of `--steps`: mlx-lm's model as it is, eager, without
the server's CPU kernels (engine/cpu_attention.py, the head's layout). It imports mlx and
mlx-lm only, so it runs where the server's other dependencies are not installed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

# hidden, layers, attention heads, KV heads, MLP width, vocabulary, tied embeddings
SHAPES = {
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True),  # HuggingFaceTB/SmolLM2-135M-Instruct
    "llama-8b": (4096, 32, 32, 8, 14336, 128256, False),  # Llama 3.1 8B
}
_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def build(shape: str, dtype: mx.Dtype) -> llama.Model:
    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            **dict(zip(_FIELDS, SHAPES[shape], strict=True)),
        }
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def step_ms(model: llama.Model, cache: list, batch: int, width: int, steps: int) -> float:
    times = []
    for _ in range(steps + 2):
        tokens = mx.random.randint(0, model.args.vocab_size, (batch, width))
        mx.eval(tokens)
        started = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        times.append((time.perf_counter() - started) * 1e3)
        for layer in cache:
            layer.trim(width)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model = build(args.shape, getattr(mx, args.dtype))
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, model.args.vocab_size, (args.batch, args.context))
    mx.eval(model(prompt, cache=cache))
    device = mx.default_device()
    print(f"{args.shape} {args.dtype} on {device}, batch {args.batch}, {args.context} cached")
    one = None
    for width in args.widths:
        ms = step_ms(model, cache, args.batch, width, args.steps)
        one = one or ms
        print(f"width {width}: {ms:.2f} ms a step, {ms / one:.2f}x one position")


if __name__ == "__main__":
    main()
