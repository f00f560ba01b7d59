"""Grammar-constrained sampling on rank 0 (llguidance): JSON output and forced tool calls.

`GrammarTokens` is llguidance's view of the tokenizer, built once when rank 0 starts
(0.6 s at 49k tokens, 2-4 s at 152k: never on the hot path). Per request, `constraint()`
compiles a JSON schema (1-4 ms) into a `TokenConstraint`, or raises `UnsupportedSchema`
naming the feature llguidance cannot enforce (the API answers 400). Each step the
constraint gives the allowed tokens as packed bits (token t is bit t % 32 of int32 word
t // 32), the batched sampler (engine/batch_sampler.py) sets every other logit to -inf
inside the step's graph, and `consume` advances the grammar with the sampled token.

JSON is compact (", " and ": " between items, no other whitespace): with free
whitespace a weak model can pad forever. Strings without maxLength still need not end;
max_tokens bounds them (finish_reason "length").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ipc.protocol import OutputFormat, ToolChoice, ToolSpec

log = logging.getLogger("ring.scheduler")

try:  # llguidance's Linux wheel needs glibc 2.31+; without it constraints are refused
    import llguidance
    import llguidance.hf

    _IMPORT_ERROR = ""
except ImportError as exc:  # pragma: no cover - depends on the host
    llguidance = None  # type: ignore[assignment]
    _IMPORT_ERROR = str(exc)

JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,  # unimplemented keywords are errors (a 400), never silently dropped
    "coerce_one_of": False,
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class UnsupportedSchema(ValueError):
    """A schema (or tool parameters) the grammar cannot enforce; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def output_schema(output: OutputFormat) -> dict[str, Any]:
    """The JSON schema of a response format: any object, or the given schema."""
    if output.type == "json_object":
        return {"type": "object"}
    if not isinstance(output.json_schema, dict):
        raise UnsupportedSchema(output.param, "the schema must be a JSON object")
    return output.json_schema


def takes_arguments(tool: ToolSpec) -> bool:
    """False for a tool whose parameters declare nothing (an empty object is its input)."""
    declared = set(tool.parameters) - {"type", "properties", "required", "description", "title"}
    return bool(tool.parameters.get("properties")) or bool(declared)


def tool_call_schema(tools: list[ToolSpec], choice: ToolChoice) -> dict[str, Any]:
    """The schema of one forced call, {"name": ..., "arguments": {...}}: any of the tools
    (required) or the named one; `name` comes first (llguidance keeps schema order)."""
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    if not chosen:
        names = ", ".join(t.name for t in tools) or "none"
        raise UnsupportedSchema(
            "tool_choice", f"no tool named {choice.name!r} in tools (tools: {names})"
        )
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                "arguments": tool.parameters if takes_arguments(tool) else NO_ARGUMENTS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in chosen
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


class TokenConstraint:
    """One request's grammar state: the allowed tokens now, advanced by each sampled one."""

    def __init__(self, matcher: Any, words: int) -> None:
        self._matcher = matcher
        self._bits = np.zeros(words, dtype=np.int32)
        self.mask_ms = 0.0  # a mask's time, a running average (a proposal's cost to the rule)

    def mask(self) -> np.ndarray:
        """The allowed next tokens as packed bits (EOS only once the text is complete)."""
        return self._mask_into(self._bits)

    def _mask_into(self, bits: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        ms = (time.perf_counter() - started) * 1000
        self.mask_ms = ms if not self.mask_ms else self.mask_ms + 0.2 * (ms - self.mask_ms)
        return bits

    def consume(self, token: int) -> None:
        """Advance by the sampled token; a token the mask forbade is a bug, so it raises."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self._matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar allows no alternative to from here, in llguidance's
        tokenization of the forced text (the model may write it in other tokens)."""
        return list(self._matcher.compute_ff_tokens())

    def allowed_run(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from here, the grammar allows (nothing consumed)."""
        return int(self._matcher.validate_tokens(tokens)) if tokens else 0

    def masks_after(self, tokens: list[int]) -> list[np.ndarray]:
        """The allowed next tokens after each of `tokens[:1]`, `tokens[:2]`, ... (a
        speculative step's later positions, each given the proposals before it), each an
        array of its own; the state is rolled back after. `tokens` must be a run the grammar
        allows (`allowed_run`)."""
        masks = []
        for token in tokens:  # each its own array: mask()'s may be in the step's rows
            self.consume(token)
            masks.append(self._mask_into(np.zeros_like(self._bits)))
        if tokens and not self._matcher.rollback(len(tokens)):
            raise RuntimeError(f"the grammar could not roll back: {self._matcher.get_error()}")
        return masks

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return bool(self._matcher.is_stopped())


class GrammarTokens:
    """llguidance's tokenizer info for the served model; immutable, built once."""

    def __init__(self, tokenizer: TokenizerWrapper, n_vocab: int, eos_ids: Iterable[int]) -> None:
        if llguidance is None:
            raise RuntimeError(f"llguidance is not installed ({_IMPORT_ERROR})")
        started = time.perf_counter()
        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        self.info = llguidance.hf.from_tokenizer(
            inner, n_vocab=n_vocab, eos_token=sorted(set(eos_ids))
        )
        self.build_seconds = time.perf_counter() - started

    @classmethod
    def build(
        cls, tokenizer: TokenizerWrapper, n_vocab: int, eos_ids: Iterable[int]
    ) -> GrammarTokens | None:
        """Build and log it; None (logged) when llguidance is missing or cannot read the
        tokenizer: constrained requests are then refused with the reason."""
        try:
            tokens = cls(tokenizer, n_vocab, eos_ids)
        except Exception as exc:  # a tokenizer llguidance cannot read must not stop serving
            log.warning("grammar-constrained output is off: %s", exc)
            return None
        log.info(
            "grammar tokenizer for constrained output: %d tokens in %.2f s",
            n_vocab,
            tokens.build_seconds,
        )
        return tokens

    def constraint(self, schema: dict[str, Any], param: str) -> TokenConstraint:
        """A fresh constraint for `schema`; UnsupportedSchema names what cannot be enforced."""
        assert llguidance is not None
        if "x-guidance" in schema:  # llguidance's own option key: the server sets the options
            schema = {k: v for k, v in schema.items() if k != "x-guidance"}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise _unsupported(param, str(exc)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.info)
        if is_error:
            raise _unsupported(param, messages[0] if messages else "invalid schema")
        matcher = llguidance.LLMatcher(self.info, grammar, log_level=0)
        if matcher.is_error():
            raise _unsupported(param, matcher.get_error())
        return TokenConstraint(matcher, self.words)


def _unsupported(param: str, reason: str) -> UnsupportedSchema:
    # Regex errors span lines and put the reason last; keep all of it on one line.
    reason = " ".join(reason.split())
    return UnsupportedSchema(
        param,
        f"the schema cannot be enforced by constrained sampling ({reason}); remove or "
        "rewrite that part (supported: type, enum, const, properties, required, "
        "additionalProperties, items, min/maxItems, anyOf, $defs/$ref, string lengths, "
        "pattern, format, numeric bounds)",
    )
