"""The system prompt the Anthropic adapter renders: Claude Code's billing header, whose
suffix changes with each session, is set aside wherever it opens a block or the string,
and nothing else is."""

from __future__ import annotations

from gateway.anthropic.convert import system_text
from gateway.anthropic.protocol import SystemText

HEADER = "x-anthropic-billing-header: cc_version=2.1.{}; cc_entrypoint=sdk-cli;"


def blocks(*texts: str) -> list[SystemText]:
    return [SystemText(text=text) for text in texts]


def test_a_header_block_is_left_out_whatever_its_suffix():
    first = system_text(blocks(HEADER.format("328.80a"), "You are an agent.", "Tools follow."))
    second = system_text(blocks(HEADER.format("332.4f9"), "You are an agent.", "Tools follow."))
    assert first == second == "You are an agent.\nTools follow."


def test_a_header_line_opening_a_block_or_the_string_goes_and_the_rest_stays():
    opened = f"{HEADER.format('1')}\nYou are an agent."
    assert system_text(blocks(opened, "More.")) == "You are an agent.\nMore."
    assert system_text(opened) == "You are an agent."
    assert system_text(HEADER.format("2")) == ""


def test_text_that_only_mentions_the_header_is_kept():
    later = f"You are an agent.\n{HEADER.format('3')}"
    assert system_text(later) == later
    assert system_text(blocks("Plain.", later)) == f"Plain.\n{later}"
    assert system_text(None) == system_text([]) == ""
