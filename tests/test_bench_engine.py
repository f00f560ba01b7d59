"""The benches that run the batch engine in one process (bench/compiled_decode.py,
engine_steps.py, trace_cost.py), each on a tiny model: they run, and print what they
measured."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.bench_module import run_bench


def test_compiled_decode_bench_decodes_the_same_tokens_every_way(tiny_llama: Path) -> None:
    args = ["--model", str(tiny_llama), "--tokens", "6", "--rounds", "1"]
    out = run_bench("compiled_decode", *args)
    assert "same greedy tokens every way: True" in out
    assert out.count("ms a token") == 3


def test_engine_steps_bench_prefills_together_then_decodes(tiny_llama: Path) -> None:
    for layout in ([], ["--layout", "plain", "--eager"]):
        args = ["--model", str(tiny_llama), "--batch", "3", "--prompt", "9", "--steps", "5"]
        out = run_bench("engine_steps", *args, *layout)
        assert "batch 3 x 9 prompt tokens: prefill" in out
        assert "(median of 4;" in out  # the first decode step is not counted


def test_trace_cost_bench_speculates_as_the_rule_did_and_counts_traces(tiny_llama: Path) -> None:
    args = ["--model", str(tiny_llama), "--prompt", "100", "--tokens", "80", "--rows", "2"]
    figures = r": (\d+) tokens a row in (\d+) steps.*; (\d+) traces"
    plain = re.search("plain" + figures, run_bench("trace_cost", *args, "--plain"))
    assert plain and plain[1] == plain[2] == "80"  # one token a step
    assert plain[3] == "2"  # one width at two buffer lengths (100 + 80 positions)
    fast = re.search("speculating" + figures, run_bench("trace_cost", *args))
    assert fast and int(fast[1]) >= 80 and int(fast[2]) < 80 and int(fast[3]) > 2
