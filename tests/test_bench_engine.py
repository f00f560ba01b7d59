"""The benches that run the batch engine in one process (bench/compiled_decode.py,
engine_steps.py, trace_cost.py, spec_replay.py), each on a tiny model: they run, and print
what they measured."""

from __future__ import annotations

import json
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


def test_spec_replay_bench_replays_each_answer_through_the_rule(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Answers generated once and kept in the cache; the step costs measured, or given."""
    chats = [
        {"name": name, "messages": [{"role": "user", "content": text}], "max_tokens": 24}
        for name, text in (("one", "Say something."), ("two", "Copy this: a b c d e f g."))
    ]
    (tmp_path / "chats.json").write_text(json.dumps(chats))
    args = ["--model", str(tiny_llama), "--chats", str(tmp_path / "chats.json")]
    args += ["--answers", str(tmp_path / "answers.json")]
    row = r"^\| (one|two) \| (\d+) \| .* \| (\d+) \| (\d+\.\d+) \| (\d+\.\d+)x \|$"
    measured = run_bench("spec_replay", *args)
    curve = r"relative to 1: 1: 1\.00, 2: \d\.\d\d, .* 9: \d+\.\d\d; a new shape: -?\d+\.\d\d\n"
    assert re.search(curve, measured)
    assert [found[0] for found in re.findall(row, measured, re.M)] == ["one", "two"]
    assert "  one: " in measured  # generated here
    given = run_bench("spec_replay", *args, "--costs", "1:1,9:1.5", "--trace", "2")
    assert "  one: " not in given  # from the cache
    assert "9: 1.50; a new shape: 2.00" in given
    for _, tokens, steps, per_step, _ in re.findall(row, given, re.M):
        assert 1 <= int(steps) <= int(tokens)
        assert abs(float(per_step) - int(tokens) / int(steps)) < 0.01
