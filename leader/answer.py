"""One request's answer on rank 0: tokens -> text (never splitting a character) -> stop
strings -> channels (answer text, reasoning, tool calls) -> the pieces a Delta carries.

Three shapes: free text split by the model's thinking and tool-call markers (tool blocks
parsed into calls as each closes), a grammar-forced call streamed as argument pieces, or
grammar-constrained JSON (all answer text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ipc.protocol import ToolCallDelta, ToolSpec
from leader.channels import ChannelSplitter, Markers, Split
from leader.detokenize import IncrementalDecoder, StopFilter
from leader.tool_calls import FALLBACK_FORMAT, ForcedCallStream, ToolFormat, parse_calls


@dataclass
class Piece:
    """New output of one step (or of the end)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: Piece) -> Piece:
        """Append `other`; argument pieces of the same call join into one."""
        self.text += other.text
        self.reasoning += other.reasoning
        for call in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and call.id is None and last.index == call.index:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(call.model_copy())
        return self

    def __bool__(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls)


class Trim:
    """Text streamed without its leading whitespace (when asked) and with its trailing
    whitespace held until more text follows: what a model writes around its markers
    (after </think>, between tool calls) is not part of the answer."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def push(self, text: str, strip_leading: bool, hold_trailing: bool) -> str:
        if not self.started and strip_leading:
            text = text.lstrip()
        text = self.held + text
        body = text.rstrip() if hold_trailing else text
        self.held = text[len(body) :]
        self.started = self.started or bool(body)
        return body

    def release(self, keep: bool) -> str:
        held, self.held = self.held, ""
        return held if keep else ""


@dataclass
class AnswerShape:
    """How to read this request's answer."""

    markers: Markers = field(default_factory=Markers)
    starts_in_reasoning: bool = False
    tools: list[ToolSpec] = field(default_factory=list)
    tool_format: ToolFormat = FALLBACK_FORMAT
    forced_call: bool = False  # the grammar writes exactly one call's JSON
    parallel_tool_calls: bool = True


class AnswerStream:
    """Feeds tokens through the decoder, the stop filter and the channels."""

    def __init__(self, tokenizer: TokenizerWrapper, stops: list[str], shape: AnswerShape) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopFilter(stops)
        self.shape = shape
        self.splitter = ChannelSplitter(shape.markers, shape.starts_in_reasoning)
        self.forced = ForcedCallStream() if shape.forced_call else None
        self.calls = 0  # tool calls sent so far
        self.reasoned = shape.starts_in_reasoning
        self.content = Trim()
        self.reasoning = Trim()

    @property
    def stop_sequence(self) -> str | None:
        return self.stops.matched

    def push(self, token: int) -> tuple[Piece, bool]:
        """The output this token completes, and whether a stop string ended the answer."""
        text, hit = self.stops.push(self.decoder.add(token))
        return self._route(text), hit

    def finish(self, complete: bool) -> Piece:
        """Whatever is held back, at the end. `complete`: the answer ended normally (EOS,
        a stop string, the grammar), not at max_tokens."""
        piece = Piece()
        if not complete:
            tail, _ = self.stops.push(self.decoder.flush())
            piece.add(self._route(tail))
        piece.add(self._route(self.stops.flush()))
        if self.forced is not None:
            piece.tool_calls += self.forced.finish(complete)
            return piece
        piece.add(self._split(self.splitter.finish()))
        piece.text += self.content.release(keep=not self.calls)
        return piece

    def _route(self, text: str) -> Piece:
        if not text:
            return Piece()
        if self.forced is not None:
            calls = self.forced.push(text)
            self.calls = 1 if self.forced.started else 0
            return Piece(tool_calls=calls)
        return self._split(self.splitter.push(text))

    def _split(self, split: Split) -> Piece:
        piece = Piece()
        for channel, text in split.segments:
            if channel == "reasoning":
                self.reasoned = True
                piece.reasoning += self.reasoning.push(text, strip_leading=True, hold_trailing=True)
            elif channel == "content":
                piece.text += self._content(text)
            else:
                self._tool_block(piece, text)
        if self.splitter.state != "reasoning":
            self.reasoning.release(keep=False)  # the whitespace before </think>
        return piece

    def _content(self, text: str) -> str:
        return self.content.push(
            text, strip_leading=self.reasoned, hold_trailing=bool(self.shape.tools)
        )

    def _tool_block(self, piece: Piece, block: str) -> None:
        fmt = self.shape.tool_format
        calls = parse_calls(fmt, block, self.shape.tools, self.calls)
        if calls is None:  # not a call after all: give the block back as text, in place
            piece.text += self._content(f"{fmt.start}{block}{fmt.end}")
            return
        if not self.shape.parallel_tool_calls:
            calls = calls[: max(0, 1 - self.calls)]
        self.calls += len(calls)
        self.content.release(keep=False)  # whitespace before a call is not an answer
        piece.tool_calls += calls
