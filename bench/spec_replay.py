"""Speculation's rule on any prompt without a server: each workload's greedy answer, replayed
through rank 0's own Speculator (prompt lookup, the per-step rule, its evidence and
odds), each step priced by a cost curve.

    .venv/bin/python -m bench.spec_replay [--set tuned|held-out|all|own-files] \
        [--chats FILE] [--costs 1:1,2:1.4,4:1.8,9:2.3 [--trace 1.2]] [--answers CACHE.json]

A greedy answer is the same whether or not speculation runs (leader/speculation.py), so
it is generated once, plainly (mlx-lm, one process), and each step of the replay samples
the answer's own tokens: position j of a step gets the answer's token there, as the
model would draw it. The rule sees what rank 0 sees: its proposals, what was accepted,
and each step's cost, which it measures as it goes (`Speculator.observe`). The curve is
measured here (the batch engine's decode step of 1 to 9 positions over a prompt as long
as the workloads', median of its steps, relative to 1 position) unless `--costs` gives
one: a Mac's steps, bound by reading the weights, cost nearly the same at 1 and 9. A step
that makes a new compiled shape (leader/new_shapes.py) costs `--trace` plain steps more:
measured with the curve (each width's first step over its median), 0 with `--costs`
unless given.

Replayed on/off is the decode time of speculation off (one step a token) over the
replay's: what `bench.spec_edits` measures from a server's streamed chunks, less what a
server adds besides (streaming, its steps' spread). It answers in a minute where a served pass
over the workloads takes half an hour, so a change to the rule can be tried on many more
prompts than a server has time for: `--chats FILE` takes any chats (a JSON list of
{"name", "messages", "max_tokens"}), `--set own-files` edits this repository's own files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from bench.agents import rendered
from bench.compiled_decode import DEFAULT_MODEL
from bench.edit_workloads import SETS, Workload, copied
from bench.engine_steps import first_plan, next_plan, served_model
from bench.own_workloads import own_files
from engine.batch_engine import BatchEngine
from engine.compiled_decode import CompiledDecode
from engine.step_plan import step_width
from ipc.protocol import SamplingParams, Submit
from leader.answer import AnswerShape, AnswerStream
from leader.new_shapes import NewShapes
from leader.request import Request
from leader.request_setup import Refusal, RequestSetup
from leader.sampler import RequestSampler
from leader.spec_rule import StepCosts
from leader.speculation import Speculator

WIDTHS = (1, 2, 3, 4, 5, 7, 9)  # positions a step: the curve's measured points


@dataclass
class Replay:
    tokens: int  # the answer's, its end included
    steps: int
    cost: float  # the steps' cost, in plain steps
    off: float  # speculation off's: a plain step a token after the first (the prefill's)
    accepted: list[bool]  # per answer token: an accepted proposal

    @property
    def on_off(self) -> float:
        """Decode speed with speculation over without."""
        return self.off / self.cost


def parse_costs(text: str) -> dict[int, float]:
    """'1:1,2:1.4,9:2.3' -> {1: 1.0, 2: 1.4, 9: 2.3}."""
    pairs = (item.split(":") for item in text.split(","))
    return {int(width): float(cost) for width, cost in pairs}


def curve(costs: dict[int, float]) -> StepCosts:
    """Step costs by positions (rows: one request), linear between the given points."""
    widths = sorted(costs)
    values = [costs[width] for width in widths]
    return StepCosts(prior=lambda rows: float(np.interp(rows, widths, values)))


def measure_costs(model_dir: Path, prompt: int, steps: int = 12) -> tuple[dict[int, float], float]:
    """The batch engine's decode step of each width in WIDTHS over a `prompt`-token
    context, one row, compiled as served: median ms, relative to one position; and what
    a new shape adds (each width's first step, which traces it, over its median: the
    median of those), in plain steps."""
    model = served_model(model_dir)
    engine = BatchEngine(model, max(256, prompt), compiled=CompiledDecode(model))
    engine.apply(first_plan(engine, model.args.vocab_size, 1, prompt))
    result = engine.run()
    ms: dict[int, float] = {}
    extra: list[float] = []
    for width in WIDTHS:
        times = []
        for _ in range(steps):
            engine.apply(next_plan(engine, result, width))
            started = time.perf_counter()
            result = engine.run()
            mx.eval(result.logits)
            times.append((time.perf_counter() - started) * 1e3)
        ms[width] = statistics.median(times[2:])
        extra.append(times[0] - ms[width])
    return {width: ms[width] / ms[1] for width in WIDTHS}, statistics.median(extra) / ms[1]


def replay(
    prompt: list[int],
    answer: list[int],
    costs: StepCosts,
    spec_tokens: int,
    tokenizer: TokenizerWrapper,
    trace: float = 0.0,
) -> Replay:
    """`answer` (its end token last) decoded by rank 0's Speculator: each step proposes,
    the rule picks the width, the answer's tokens play the model's draws; a step that
    makes a new compiled shape costs `trace` plain steps more."""
    params = SamplingParams(max_tokens=len(answer) + spec_tokens, temperature=0.0)
    request = Request(
        conn=1,
        id="replay",
        seq_id=1,
        prompt=prompt,
        submit=Submit(id="replay", prompt="-", params=params),
        sampler=RequestSampler(params, prompt, None),
        answer=AnswerStream(tokenizer, [], AnswerShape()),
        constraint=None,
        arrived=0.0,
        generated=answer[:1],
    )
    speculator = Speculator(spec_tokens, costs=costs)
    plain = costs.predict(1, eager=False)
    accepted, steps, cost = [False], 0, 0.0
    while len(request.generated) < len(answer):
        drafts = speculator.drafts([1], {1: request})
        width = step_width(drafts)
        at = len(request.generated)
        drawn = (answer[at : at + width] + [-1] * width)[:width]
        taken = speculator.accept(1, drawn, request)
        request.generated += answer[at : at + taken]
        accepted += [True] * (taken - 1) + [False]
        speculator.count(request, taken)
        ms = costs.predict(width, eager=False) + (trace * plain if speculator.new_shape else 0.0)
        speculator.observe(width, False, ms)
        steps, cost = steps + 1, cost + ms / plain
    plain_shapes = NewShapes()  # off makes a shape at each buffer length too
    first = len(prompt)
    off = sum(1 + trace * plain_shapes.take(1, 1, n) for n in range(first, first + len(answer) - 1))
    return Replay(len(answer), steps, cost, off, accepted[: len(answer)])


def greedy_answers(
    model_dir: Path, workloads: list[Workload], cache: Path | None
) -> dict[str, dict[str, list[int]]]:
    """Each workload's prompt as rank 0 renders it and its greedy answer (its end token
    last), from `cache` where it holds them for this model and prompt."""
    setup = RequestSetup(load_tokenizer(model_dir), None)
    held = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    out, model = {}, None
    for workload in workloads:
        try:  # no grammar here: a forced tool call or a schema's answer is refused
            prompt = rendered("/v1/chat/completions", workload.body(), setup)
        except Refusal as refusal:
            print(f"  {workload.name}: left out ({refusal.param}: the replay has no grammar)")
            continue
        key = hashlib.sha256(json.dumps([str(model_dir), prompt, workload.max_tokens]).encode())
        if key.hexdigest() in held:
            out[workload.name] = held[key.hexdigest()]
            continue
        if model is None:
            model, _ = load(str(model_dir))
        eos = set(setup.tokenizer.eos_token_ids)
        answer: list[int] = []
        greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
        for token, _ in generate_step(
            mx.array(prompt), model, max_tokens=workload.max_tokens, sampler=greedy
        ):
            answer.append(int(token))
            if answer[-1] in eos:
                break
        out[workload.name] = held[key.hexdigest()] = {"prompt": prompt, "answer": answer}
        print(f"  {workload.name}: {len(answer)} tokens", flush=True)
        if cache is not None:  # each answer as it comes: generating them takes minutes
            cache.write_text(json.dumps(held))
    return out


def chats(path: Path) -> list[Workload]:
    return [
        Workload(item["name"], item["messages"], int(item.get("max_tokens", 400)))
        for item in json.loads(path.read_text())
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--set", choices=[*SETS, "own-files"], default="all", help="workloads")
    parser.add_argument("--chats", type=Path, help="a JSON list of chats instead of --set")
    parser.add_argument("--costs", help="'width:cost,...' relative to 1 (default: measured)")
    parser.add_argument("--trace", type=float, help="a new shape's extra, in plain steps")
    parser.add_argument("--spec-tokens", type=int, default=8)
    parser.add_argument("--answers", type=Path, help="a cache of greedy answers (JSON)")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    if args.chats:
        workloads = chats(args.chats)
    else:
        workloads = own_files() if args.set == "own-files" else SETS[args.set]
    answers = greedy_answers(args.model, workloads, args.answers)
    if args.costs:
        costs, trace = parse_costs(args.costs), args.trace or 0.0
    else:
        longest = max(len(item["prompt"]) for item in answers.values())
        costs, trace = measure_costs(args.model, min(longest, 2048))
        trace = trace if args.trace is None else args.trace
    shown = ", ".join(f"{width}: {cost:.2f}" for width, cost in sorted(costs.items()))
    print(f"step cost by positions, relative to 1: {shown}; a new shape: {trace:.2f}")
    print("| workload | tokens | copied | accepted of copied | steps | tokens a step | on/off |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    for workload in [workload for workload in workloads if workload.name in answers]:
        item = answers[workload.name]
        result = replay(
            item["prompt"], item["answer"], curve(costs), args.spec_tokens, tokenizer, trace
        )
        mask = copied(item["answer"], item["prompt"])
        hits = [ok for ok, hit in zip(result.accepted, mask, strict=True) if hit]
        share = f"{sum(hits) / len(hits):.0%}" if hits else "-"
        ratios.append(result.on_off)
        print(
            f"| {workload.name} | {result.tokens} | {sum(mask) / result.tokens:.0%} | {share} | "
            f"{result.steps} | {result.tokens / result.steps:.2f} | {result.on_off:.2f}x |"
        )
    print(f"geometric mean on/off: {math.exp(statistics.fmean(map(math.log, ratios))):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
