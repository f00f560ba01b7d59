"""Split an answer's streamed text by the model's markers: answer text, reasoning (inside
the thinking markers) and tool-call blocks.

Markers are removed; a piece that may be the start of a marker is held back until the
next text decides. A tool block is reported whole, once its end marker arrives (or at the
end of the answer, for formats whose calls run to the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from leader.detokenize import partial_marker

Channel = Literal["content", "reasoning", "tool"]


@dataclass
class Markers:
    """The markers to look for; None: that channel does not exist for this request."""

    think: tuple[str, str] | None = None
    tool: tuple[str, str] | None = None  # an empty end: the block runs to the end


@dataclass
class Split:
    """What one push produced, in order: text per channel, and each tool block completed
    (channel "tool", the text between its markers)."""

    segments: list[tuple[Channel, str]] = field(default_factory=list)

    def add(self, channel: Channel, text: str) -> None:
        if self.segments and self.segments[-1][0] == channel != "tool":
            self.segments[-1] = (channel, self.segments[-1][1] + text)
        else:
            self.segments.append((channel, text))

    def text(self, channel: Channel) -> str:
        return "".join(text for kind, text in self.segments if kind == channel)

    @property
    def content(self) -> str:
        return self.text("content")

    @property
    def reasoning(self) -> str:
        return self.text("reasoning")

    @property
    def tool_blocks(self) -> list[str]:
        return [text for kind, text in self.segments if kind == "tool"]


class ChannelSplitter:
    """A state machine over the text: content -> reasoning on the think start, back on its
    end; content -> tool on the tool start, back on its end."""

    def __init__(self, markers: Markers, start_in_reasoning: bool = False) -> None:
        self.markers = markers
        self.state: Channel = "reasoning" if start_in_reasoning and markers.think else "content"
        self._pending = ""  # text not yet assigned (may hold a partial marker)
        self._tool = ""  # the open tool block's text so far

    def _openers(self) -> list[tuple[str, Channel]]:
        found: list[tuple[str, Channel]] = []
        if self.markers.think:
            found.append((self.markers.think[0], "reasoning"))
        if self.markers.tool:
            found.append((self.markers.tool[0], "tool"))
        return found

    def _closer(self) -> str:
        if self.state == "reasoning" and self.markers.think:
            return self.markers.think[1]
        if self.state == "tool" and self.markers.tool:
            return self.markers.tool[1]
        return ""

    def push(self, text: str) -> Split:
        out = Split()
        self._pending += text
        while self._pending:
            if self.state == "content":
                hits = [(self._pending.find(m), m, ch) for m, ch in self._openers() if m]
                hits = [hit for hit in hits if hit[0] >= 0]
                if not hits:
                    self._emit(out, self._release([m for m, _ in self._openers()]))
                    break
                at, marker, channel = min(hits, key=lambda hit: hit[0])
                self._emit(out, self._pending[:at])
                self._pending = self._pending[at + len(marker) :]
                self.state = channel
                continue
            closer = self._closer()
            at = self._pending.find(closer) if closer else -1
            if at < 0:
                self._emit(out, self._release([closer] if closer else []))
                break
            self._emit(out, self._pending[:at])
            self._pending = self._pending[at + len(closer) :]
            if self.state == "tool":
                out.add("tool", self._tool)
                self._tool = ""
            self.state = "content"
        return out

    def finish(self) -> Split:
        """The end of the answer: held-back text goes out, an open tool block is reported
        (its format may have no end marker)."""
        out = Split()
        self._emit(out, self._pending)
        self._pending = ""
        if self.state == "tool":
            out.add("tool", self._tool)
            self._tool = ""
        return out

    def _release(self, markers: list[str]) -> str:
        """The pending text minus its longest end that could start one of `markers`."""
        cut = len(self._pending) - partial_marker(self._pending, markers)
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released

    def _emit(self, out: Split, text: str) -> None:
        if not text:
            return
        if self.state == "tool":
            self._tool += text
        else:
            out.add(self.state, text)

    @property
    def open_tool_block(self) -> str:
        """The text of a tool block still open (to give back as text if it never parses)."""
        return self._tool
