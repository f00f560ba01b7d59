"""Prompts the benchmarks send: essays that run to max_tokens, long documents to
summarize, and a coding agent's long system prompt with its questions. Each carries a tag
so no server answers it from a prompt cache an earlier request filled."""

from __future__ import annotations

from collections.abc import Callable

TOPICS = [
    "the history of the printing press",
    "how a steam engine works",
    "the life cycle of stars",
    "the water cycle on Earth",
    "how bridges are designed and built",
    "the invention of the telephone",
    "how vaccines train the immune system",
    "the rise and fall of the Roman Empire",
]
LONG_SENTENCE = (
    "In year {i} the village by the river built {n} new houses, planted {m} apple trees, "
    "repaired the old stone bridge and held a market where farmers sold grain, wool and "
    "honey to travellers from the northern towns."
)


def essay_prompt(index: int, tag: str) -> str:
    """A request that invites a long answer, so generation runs to max_tokens."""
    topic = TOPICS[index % len(TOPICS)]
    return (
        f"[{tag}] Write a long, detailed essay about {topic}. Explain every step, give many "
        "examples, and do not stop early."
    )


def long_prompt(target_tokens: int, tag: str, count: Callable[[str], int] | None = None) -> str:
    """A document of about `target_tokens` tokens and a request to summarize it.
    `count` measures tokens (a tokenizer); without it, 1.3 tokens per word is assumed."""
    count = count or (lambda text: round(len(text.split()) * 1.3))
    head = f"[{tag}] Read this chronicle of a village.\n\n"
    tail = "\n\nSummarize the chronicle above in detail, year by year."
    sentences: list[str] = []
    while count(head + " ".join(sentences) + tail) < target_tokens:
        i = len(sentences)
        sentences.append(LONG_SENTENCE.format(i=1700 + i, n=3 + i % 7, m=10 + i % 13))
    return head + " ".join(sentences) + tail


def agent_system_prompt(target_tokens: int, tag: str, count: Callable[[str], int]) -> str:
    """A coding agent's long system prompt (tools, rules, a project map) of about
    `target_tokens` tokens, unique per `tag`."""
    rule = (
        "Rule {i}: before you change file module_{i}.py, read it, run its tests, keep the "
        "public names stable, explain the change in one line and never touch generated code."
    )
    head = f"[{tag}] You are a coding agent working in a large repository.\n"
    rules: list[str] = []
    while count(head + "\n".join(rules)) < target_tokens:
        rules.append(rule.format(i=len(rules)))
    return head + "\n".join(rules)


AGENT_QUESTIONS = [
    "List the three rules you consider most important.",
    "Which module would you read first, and why?",
    "Summarize your plan in two sentences.",
    "What will you check before you finish?",
]
