"""From a Submit to what rank 0 runs: the prompt's tokens, how to read the answer (its
channels and tool format), and the grammar constraint if the answer is forced.

Everything a client can get wrong is found here, before the request is queued, and
raised as a `Refusal` that names the field: the request never reaches the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ipc.protocol import ErrorCode, Submit
from leader.answer import AnswerShape
from leader.channels import Markers
from leader.chat_prompt import ChatPrompt, forced_call, offered_tools
from leader.constraints import (
    GrammarTokens,
    TokenConstraint,
    UnsupportedSchema,
    output_schema,
    tool_call_schema,
)


class Refusal(Exception):
    """A request rank 0 will not run: the error code, the message and the field at fault."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param


@dataclass
class SetupResult:
    prompt: list[int]
    shape: AnswerShape
    constraint: TokenConstraint | None


class RequestSetup:
    """Rank 0's per-tokenizer tools for setting requests up."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        grammar: GrammarTokens | None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = ChatPrompt(tokenizer)
        self.grammar = grammar
        # the model's embedding rows: MLX's gather does not check its indices, so a token
        # past them would read whatever memory follows the table (garbage logits)
        self.vocab_size = vocab_size

    def prepare(self, submit: Submit) -> SetupResult:
        if (submit.messages is None) == (submit.prompt is None):
            raise Refusal(
                "invalid_request", "give exactly one of 'messages' (chat) or 'prompt' (completion)"
            )
        constraint = self._constraint(submit)
        shape = AnswerShape(
            tools=offered_tools(submit),
            tool_format=self.chat.tool_format,
            forced_call=forced_call(submit),
            parallel_tool_calls=submit.parallel_tool_calls,
        )
        opens_thinking = False
        try:
            if submit.messages is not None:
                rendered = self.chat.render(submit, constrained=constraint is not None)
                opens_thinking = rendered.starts_in_reasoning
                prompt = list(self.tokenizer.encode(rendered.text, add_special_tokens=False))
            else:
                prompt = list(self.tokenizer.encode(submit.prompt or ""))
        except Exception as exc:  # a template or tokenizer rejecting this input
            raise Refusal("invalid_request", f"cannot tokenize the prompt: {exc}") from None
        if not prompt:
            raise Refusal(
                "invalid_request",
                "the prompt is empty after tokenization; send at least one token",
            )
        if self.vocab_size is not None and (highest := max(prompt)) >= self.vocab_size:
            raise Refusal(
                "internal",
                f"the tokenizer gave token id {highest}, but the model has only "
                f"{self.vocab_size} embedding rows: its tokenizer files do not match its "
                "weights (use the tokenizer shipped with this model)",
            )
        if constraint is None and submit.messages is not None:  # a grammar leaves no markers
            think = self.chat.think if submit.enable_thinking is not False else None
            tool = self.chat.tool_format
            shape.markers = Markers(think, (tool.start, tool.end) if shape.tools else None)
            shape.starts_in_reasoning = think is not None and opens_thinking
        return SetupResult(prompt, shape, constraint)

    def _constraint(self, submit: Submit) -> TokenConstraint | None:
        """The grammar of a forced tool call, else of the output format, else None."""
        forced = forced_call(submit)
        if not forced and submit.output is None:
            return None
        if self.grammar is None:
            field = "tool_choice" if forced else submit.output.param if submit.output else ""
            raise Refusal(
                "invalid_request",
                "constrained output (a forced tool call or a JSON response format) is off on "
                "this server: rank 0 could not load llguidance (see server.log); leave "
                f"{field} out",
                field,
            )
        try:
            if forced:
                schema = tool_call_schema(submit.tools, submit.tool_choice)
                return self.grammar.constraint(schema, "tools")
            assert submit.output is not None
            return self.grammar.constraint(output_schema(submit.output), submit.output.param)
        except UnsupportedSchema as exc:
            raise Refusal("invalid_request", f"Invalid {exc.param}: {exc}", exc.param) from None
