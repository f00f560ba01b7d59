"""Workloads nobody wrote for the rule: edits of this repository's own files (read when
asked: they change with it, and so do the answers) and eight free texts of other kinds,
for bench/spec_replay.py, which replays them without a server."""

from __future__ import annotations

from bench.edit_workloads import WHOLE, Workload
from config.settings import PROJECT_DIR

# (name, a file of this repository, its language, the change asked, max_tokens)
OWN_EDITS = [
    ("own: rename in python", "leader/burst.py", "python", "rename `burst` to `take_burst`", 600),
    ("own: comment in python", "leader/sampler.py", "python", "a comment line at the top", 1200),
    ("own: bash", "scripts/settings.sh", "bash", "print 'done' at the end", 600),
    ("own: toml", "pyproject.toml", "toml", "requires-python is >=3.12", 600),
    ("own: bash, names", "scripts/ranks.sh", "bash", "every local variable in upper case", 900),
]
FREE_ASKS = {
    "story": "Write a short story about a fox who learns to swim.",
    "list": "List ten tips for keeping houseplants alive, one line each.",
    "explain": "Explain how a bicycle's gears work to a ten-year-old.",
    "letter": "Write a cover letter for a job as a baker.",
    "table": "What are the differences between TCP and UDP? Answer in a table.",
    "poem": "Write a poem about winter mornings in the city.",
    "bullets": "Summarise the causes of the French Revolution in five bullet points.",
    "recipe": "Give me a recipe for lentil soup with quantities.",
}


def own_files() -> list[Workload]:
    """OWN_EDITS of this repository's files, read now, and FREE_ASKS."""
    edits = []
    for name, path, language, change, max_tokens in OWN_EDITS:
        user = (
            f"Here is {path}:\n\n```{language}\n{(PROJECT_DIR / path).read_text()}```\n\n"
            f"Return the whole file with one change: {change}. {WHOLE}"
        )
        edits.append(Workload(name, [{"role": "user", "content": user}], max_tokens))
    free = [
        Workload(f"free: {name}", [{"role": "user", "content": ask}], 300, edit=False)
        for name, ask in FREE_ASKS.items()
    ]
    return edits + free
