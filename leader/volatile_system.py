"""An agent's system prompt, its per-directory paragraphs last: what a new session in another
project shares with the last one comes first, where the prefix cache can reuse it.

Coding agents name the project's directory inside their system prompt, ahead of most of
what every session sends alike: Claude Code's memory directory (derived from the working
directory, about 800 tokens into a 12,500-token prompt whose tools follow), opencode's
`<env>` block (working directory and date, ahead of its tools). A prefix's KV depends on
every token before it, so a session started in another directory reused only the tokens
before that path: 821 of Claude Code's 12,492, 1,974 of opencode's 7,716 (measured with the
pinned clients, two sessions in two directories). Codex names it in a user message, after
its instructions and tools.

So where a request offers tools (an agent's), each paragraph of its first system message
that names an absolute filesystem path (not a URL's) moves after the rest, in its order:
the model sees every word the client sent, the directory's paragraphs after the tools:
in the fallback tool prompt's system message, or, where the template renders the tools
after the first system message itself, in a second system message (leader/chat_prompt.py;
a template that refuses one gets them where more of the prompt comes before them: the
opening of the first user message, or the end of the first system message). Nothing is
matched around content the model sees, and a chat without tools is rendered as sent.
"""

from __future__ import annotations

import re

# An absolute path of two parts or more, not inside a URL (`https://host/...`) or `~/...`.
PATH = re.compile(r"(?<![\w.~:/])/(?:[\w.@+-]+/)+[\w.@+-]*")
PARAGRAPH_BREAK = "\n\n"


def split_volatile(system: str) -> tuple[str, str]:
    """`system` as (the paragraphs that name no path, those that do), each in its order,
    joined as they were; ("", "") for an empty text."""
    stable: list[str] = []
    volatile: list[str] = []
    for paragraph in system.split(PARAGRAPH_BREAK):
        (volatile if PATH.search(paragraph) else stable).append(paragraph)
    return PARAGRAPH_BREAK.join(stable), PARAGRAPH_BREAK.join(volatile)
