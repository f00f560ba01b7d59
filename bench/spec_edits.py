"""Speculation on edit and tool-argument workloads it was not tuned on (bench/edit_workloads.py),
against mlx_lm.server as shipped and given our kernels, at 1 and 2 ranks.

    .venv/bin/python -m bench.spec_edits [--ranks 1 2] [--spec-tokens 8] [--markdown FILE] \
        [--set tuned|held-out|fresh|all] [--servers on off peer peer-rows] [--parallelism tensor]

For each rank count, servers on the same model, one after another: ours with
SPECULATIVE=auto, ours with SPECULATIVE=off, mlx_lm.server as shipped (`peer`) and with our
few-row sgemm (`peer-rows`: the engine's ratio). Above 1 rank the peer cannot split the
default model's 9 heads, and the even-head variant it could split answers gibberish, which
copies nothing: it serves the default model as ministral3 (bench/pipeline_model.py: the same
weights, tokens and logits) split by layers (`--pipeline`), and ours the model as it is,
split by `--parallelism` (tensor unless told: `auto` picks by measured speed at each start,
and the split sets the order of the sums, so two starts could give different greedy
answers). Each workload is one greedy request, alone: decode tokens/s from its streamed
chunks (first to last), as a client sees it; the table gives the answers' lengths, on and
off, so a ratio over different answers shows.

With speculation on, each workload runs once more over rank 0's socket, whose Deltas say
how many of their tokens were proposals a step accepted (`accepted`). The answer's copied
tokens (in runs of 8 or more found verbatim in the prompt as rank 0
renders it) and the share of them speculation accepted are counted there; the answer is the
same as over HTTP (greedy, the same computation whether or not its prompt was cached).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
from mlx_lm.utils import load_tokenizer

from bench.agents import rendered
from bench.compare import resolve_model_dir
from bench.edit_workloads import SETS, Workload, copied
from bench.loadgen import Endpoint, stream_chat
from bench.pipeline_model import make_pipeline_variant
from bench.run_setup import add_run_options, run_each
from bench.servers import Ours, Peer, log, wait_quiet
from bench.stats import RequestResult
from gateway.core import Limits
from gateway.openai.convert import chat_submit
from gateway.openai.protocol import ChatCompletionRequest
from ipc.client import RankClient
from ipc.protocol import Delta, Done, Error
from leader.constraints import GrammarTokens
from leader.request_setup import RequestSetup

SERVERS = ("on", "off", "peer", "peer-rows")


async def _one(endpoint: Endpoint, workload: Workload) -> RequestResult:
    timeout = httpx.Timeout(endpoint.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await stream_chat(
            client,
            endpoint,
            workload.messages,
            workload.max_tokens,
            tools=workload.tools,
            fields=workload.fields,
        )


def over_http(endpoint: Endpoint, workloads: list[Workload]) -> dict[str, dict[str, Any]]:
    """Each workload's decode tok/s (and tokens) as a client sees it."""
    asyncio.run(_one(endpoint, workloads[-1]))  # warm-up
    out = {}
    for workload in workloads:
        result = asyncio.run(_one(endpoint, workload))
        out[workload.name] = {
            "ok": result.ok,
            "error": result.error,
            "decode_tok_s": result.decode_tps,
            "tokens": result.completion_tokens,
        }
        log(f"  {workload.name}: {json.dumps(out[workload.name])}")
    return out


def accepted_flags(socket: Path, workload: Workload) -> list[tuple[int, bool]]:
    """The answer over rank 0's socket: each token, and whether it was an accepted proposal
    (a Delta's first `accepted` tokens)."""
    body = ChatCompletionRequest.model_validate(workload.body() | {"temperature": 0.0})
    submit = chat_submit(body, "share", Limits(default_max_tokens=workload.max_tokens))
    tokens: list[tuple[int, bool]] = []
    with RankClient(socket, timeout=600) as client:
        client.send(submit)
        while True:
            message = client.recv()
            if isinstance(message, Delta):
                ids = message.token_ids
                tokens += [(t, i < message.accepted) for i, t in enumerate(ids)]
            elif isinstance(message, Done):
                return tokens
            elif isinstance(message, Error) or message is None:
                raise RuntimeError(f"rank 0 answered {message}")


def copy_share(
    socket: Path, setup: RequestSetup, workloads: list[Workload]
) -> dict[str, dict[str, Any]]:
    """Per workload: the share of the answer's tokens it copied from the prompt, and of
    those the share speculation accepted."""
    out = {}
    for workload in workloads:
        try:
            flags = accepted_flags(socket, workload)
        except (RuntimeError, OSError) as exc:
            out[workload.name] = {"error": str(exc)[:200]}
            log(f"  {workload.name}: {out[workload.name]}")
            continue
        prompt = rendered("/v1/chat/completions", workload.body(), setup)
        answer = [token for token, _ in flags]
        mask = copied(answer, prompt)
        in_copies = [accepted for (_, accepted), hit in zip(flags, mask, strict=True) if hit]
        out[workload.name] = {
            "copied": sum(mask) / len(answer) if answer else 0.0,
            "accepted_of_copied": sum(in_copies) / len(in_copies) if in_copies else None,
            "accepted": sum(accepted for _, accepted in flags),
            "tokens": len(answer),
        }
        log(f"  {workload.name}: {json.dumps(out[workload.name])}")
    return out


def run_ranks(ranks: int, args: argparse.Namespace, env: dict[str, str], model: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="bench-spec-edits-"))
    tokenizer = load_tokenizer(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    # a grammar as rank 0's: a constrained request's prompt renders as the cluster renders it
    setup = RequestSetup(tokenizer, GrammarTokens.build(tokenizer, vocab, tokenizer.eos_token_ids))
    peer_model = model
    peers = {"peer", "peer-rows"} & set(args.servers)
    if ranks > 1 and peers:  # a model the peer can split: by layers, answering as ours does
        peer_model = make_pipeline_variant(model, args.cache_dir / f"ministral3-{model.name}")
    ours = env | {"PARALLELISM": args.parallelism}
    servers: dict[str, Ours | Peer] = {
        "on": Ours(
            ranks,
            ours | {"SPECULATIVE": "auto", "SPEC_TOKENS": str(args.spec_tokens)},
            model,
            workdir,
        ),
        "off": Ours(ranks, ours | {"SPECULATIVE": "off"}, model, workdir),
    }
    pipeline = ranks > 1
    servers["peer"] = Peer(ranks, env, peer_model, workdir, True, False, pipeline)  # as shipped
    servers["peer-rows"] = Peer(ranks, env, peer_model, workdir, True, True, pipeline)  # engine
    workloads = SETS[args.set]
    results: dict[str, Any] = {}
    for name, server in servers.items():
        if name not in args.servers:
            continue
        wait_quiet(args.max_load, args.load_patience)
        log(f"{name}, {ranks} rank(s): starting")
        try:
            server.start()
            results[name] = over_http(server.endpoint, workloads)
            if name == "on" and isinstance(server, Ours):
                socket = Path(server.env["SOCKET_PATH"])
                results["share"] = copy_share(socket, setup, workloads)
        finally:
            server.stop()
    return results


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _lengths(by: dict[str, Any], name: str) -> str:
    """The answer's tokens, on and off: one figure where they agree."""
    counts = [by.get(k, {}).get(name, {}).get("tokens") for k in ("on", "off")]
    known = [str(c) for c in counts if c is not None]
    return " / ".join(dict.fromkeys(known)) or "-"


def markdown(results: dict[int, dict], args: argparse.Namespace, started: str) -> str:
    lines = [
        f"Speculation on edits ({started}, `python -m bench.spec_edits --ranks "
        f"{' '.join(map(str, args.ranks))} --spec-tokens {args.spec_tokens} --set {args.set} "
        f"--parallelism {args.parallelism}`)",
        "",
    ]
    for ranks, by in results.items():
        lines += [
            f"{ranks} rank(s): decode tok/s per request",
            "",
            "| workload | tokens | copied | accepted of copied | on | off | peer | peer-rows "
            "| on/off | on/peer | on/peer-rows |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for workload in SETS[args.set]:
            name = workload.name
            share = by.get("share", {}).get(name, {})
            on, off, peer, rows = (
                by.get(k, {}).get(name, {}).get("decode_tok_s")
                for k in ("on", "off", "peer", "peer-rows")
            )
            accepted = share.get("accepted_of_copied")
            lines.append(
                f"| {name} | {_lengths(by, name)} | {share.get('copied', 0):.0%} | "
                f"{'-' if accepted is None else f'{accepted:.0%}'} | {on or 0:.1f} | "
                f"{off or 0:.1f} | {f'{peer:.1f}' if peer else '-'} | "
                f"{f'{rows:.1f}' if rows else '-'} | {_ratio(on, off)} | {_ratio(on, peer)} | "
                f"{_ratio(on, rows)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--spec-tokens", type=int, default=8)
    parser.add_argument("--set", choices=list(SETS), default="tuned", help="the workloads")
    parser.add_argument(
        "--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="those to run"
    )
    parser.add_argument(
        "--parallelism",
        default="tensor",
        help="ours' split above 1 rank (PARALLELISM): tensor, pipeline, expert or auto",
    )
    add_run_options(parser, "spec_edits")
    args = parser.parse_args(argv)
    return run_each(
        args,
        resolve_model_dir,
        run_ranks,
        lambda results, started: markdown(results, args, started),
    )


if __name__ == "__main__":
    raise SystemExit(main())
