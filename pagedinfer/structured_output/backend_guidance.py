r"""The guidance backend of structured outputs (llguidance).

Role: turn specs into llguidance grammar definitions and drive one `llguidance.LLMatcher` per
request. llguidance builds its lexer lazily, so making a matcher is cheap (about 2 ms for a
mid-size JSON schema); matchers for a spec seen before are deep copies of a cached one.

How specs map to llguidance:
- JSON: `LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": ...})`;
  `disable_any_whitespace` turns flexible whitespace off (compact JSON with "," and ":"), and
  the schema's own "x-guidance" options still win. llguidance follows JSON Schema on
  `additionalProperties` (allowed unless said otherwise); `disable_additional_properties`
  rewrites the schema to forbid them; the "date" and "date-time" formats become exact patterns
  (`exact_date_formats`: llguidance's own take "2023-02-29"). Unknown or unimplemented
  keywords are errors;
- JSON_OBJECT: the schema `{"type": "object"}`;
- REGEX: a Lark rule `start: /regex/` through `llguidance.regex_to_lark(regex, "dw")`, so that
  `\d` and `\w` are ASCII as in xgrammar (llguidance's `grammar_from_regex` would let `\d`
  match any Unicode digit); CHOICE: a Lark rule `start: "a" | "b"`;
- GRAMMAR: Lark natively; EBNF/GBNF converted to Lark by `llguidance.grammar_from("grammar")`
  (`root` becomes `start`);
- STRUCTURAL_TAG: `llguidance.StructTag`s, each with the first trigger its `begin` starts with.

Quirks handled here: consuming a token the grammar does not allow puts an LLMatcher in an error
state for good (so tokens are validated before they are consumed), and an LLMatcher's own EOS
bookkeeping depends on whether the grammar could still continue (so EOS is kept out of it, see
`MatcherGrammar`). The mask is computed straight into the bitmask row through
`LLMatcher.unsafe_compute_mask_ptr` (what `llguidance.torch.fill_next_token_bitmask` does;
importing `llguidance.torch` would cost seconds of `torch.compile` set-up), so the row's shape,
dtype and layout are checked first.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from pagedinfer.structured_output.backend import (
    MatcherGrammar,
    StructuredOutputBackend,
    bitmask_words,
)
from pagedinfer.structured_output.specs import (
    StructuredOutputOptions,
    StructuredOutputSpecError,
    choice_alternatives,
    exact_date_formats,
    forbid_additional_properties,
    grammar_is_lark,
    parse_choice,
    parse_json_schema,
    parse_structural_tag,
)
from pagedinfer.structured_output.tokenizer_info import llguidance_tokenizer

if TYPE_CHECKING:
    import llguidance

    from pagedinfer.tokenizer import Tokenizer

__all__ = ["GuidanceBackend", "GuidanceGrammar", "validate_guidance_spec"]

logger = logging.getLogger(__name__)

_ASCII_CLASSES = "dw"  # regex classes \d, \w read as ASCII

_KIND_NAMES = {
    StructuredOutputOptions.JSON: "JSON schema",
    StructuredOutputOptions.JSON_OBJECT: "JSON object spec",
    StructuredOutputOptions.REGEX: "regex",
    StructuredOutputOptions.CHOICE: "choice",
    StructuredOutputOptions.GRAMMAR: "grammar",
    StructuredOutputOptions.STRUCTURAL_TAG: "structural tag",
}


def _error(kind: StructuredOutputOptions, message: str) -> StructuredOutputSpecError:
    return StructuredOutputSpecError(
        f"llguidance cannot compile this {_KIND_NAMES[kind]}: {message.strip()}"
    )


def guidance_grammar(
    kind: StructuredOutputOptions,
    spec: str,
    *,
    disable_any_whitespace: bool = False,
    disable_additional_properties: bool = False,
) -> str:
    """The llguidance grammar definition for a spec (not yet checked by llguidance)."""
    import llguidance as llg

    matcher_cls = llg.LLMatcher
    opts = StructuredOutputOptions
    defaults: dict[str, Any] = {"whitespace_flexible": not disable_any_whitespace}
    try:
        if kind is opts.JSON:
            schema = parse_json_schema(spec)
            rewritten = exact_date_formats(schema)
            if disable_additional_properties:
                rewritten = forbid_additional_properties(rewritten)
            text = spec if rewritten is schema else json.dumps(rewritten, ensure_ascii=False)
            return matcher_cls.grammar_from_json_schema(text, defaults=defaults)
        if kind is opts.JSON_OBJECT:
            return matcher_cls.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
        if kind is opts.REGEX:
            # ASCII \d and \w, as in xgrammar and JSON schema patterns (llguidance's plain
            # regex grammar would take Unicode digits and letters).
            return matcher_cls.grammar_from_lark(
                "start: /" + llg.regex_to_lark(spec, _ASCII_CLASSES) + "/"
            )
        if kind is opts.CHOICE:
            return matcher_cls.grammar_from_lark(
                "start: " + choice_alternatives(parse_choice(spec))
            )
        if kind is opts.GRAMMAR:
            if not spec.strip():
                raise StructuredOutputSpecError("invalid grammar: the grammar is empty")
            if grammar_is_lark(spec):
                return matcher_cls.grammar_from_lark(spec)
            return llg.grammar_from("grammar", spec)  # GBNF -> Lark
        if kind is opts.STRUCTURAL_TAG:
            structures, triggers = parse_structural_tag(spec)
            tags = [
                llg.StructTag(
                    trigger=next(t for t in triggers if s["begin"].startswith(t)),
                    begin=s["begin"],
                    grammar=s["schema"],
                    end=s["end"],
                )
                for s in structures
            ]
            return llg.StructTag.to_grammar(tags)
    except StructuredOutputSpecError:
        raise
    except Exception as e:
        raise _error(kind, str(e) or type(e).__name__) from None
    raise StructuredOutputSpecError(f"the guidance backend does not support {kind}")


def validate_guidance_spec(
    kind: StructuredOutputOptions,
    spec: str,
    *,
    disable_any_whitespace: bool = False,
    disable_additional_properties: bool = False,
    tokenizer: llguidance.LLTokenizer | None = None,
) -> None:
    """ValueError if llguidance cannot take the spec. Without `tokenizer` the check skips what
    depends on the vocabulary (e.g. special-token references)."""
    import llguidance as llg

    grammar = guidance_grammar(
        kind,
        spec,
        disable_any_whitespace=disable_any_whitespace,
        disable_additional_properties=disable_additional_properties,
    )
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise _error(kind, messages[0] if messages else "invalid grammar")
    for message in messages:
        logger.debug("llguidance warning for %s: %s", _KIND_NAMES[kind], message)


class GuidanceGrammar(MatcherGrammar):
    """One request's `llguidance.LLMatcher`."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int, words: int) -> None:
        super().__init__(eos_token_id)
        self.matcher = matcher
        self._words = words

    def _check(self, what: str) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"llguidance matcher failed to {what}: {self.matcher.get_error()}")

    def _try_advance(self, tokens: list[int]) -> bool:
        if self.matcher.validate_tokens(tokens) < len(tokens):
            return False
        self.matcher.consume_tokens(tokens)
        self._check("consume validated tokens")
        return True

    def _count_valid(self, tokens: list[int]) -> int:
        return int(self.matcher.validate_tokens(tokens))

    def _can_end(self) -> bool:
        return bool(self.matcher.is_accepting())

    def _lib_rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self._check("roll back")

    def _lib_reset(self) -> None:
        self.matcher.reset()

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if (
            bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu"
            or bitmask.dim() != 2
            or bitmask.shape[1] != self._words
            or bitmask.stride(1) != 1
        ):
            raise ValueError(
                f"bitmask must be a CPU int32 tensor [rows, {self._words}] with contiguous "
                f"rows; got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)
        if self.matcher.is_error():  # e.g. a parser limit; llguidance leaves only EOS allowed
            logger.warning("llguidance matcher error: %s", self.matcher.get_error())


class GuidanceBackend(StructuredOutputBackend):
    """Structured outputs through llguidance."""

    name = "guidance"

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
        max_rollback_tokens: int = 0,
        cache_size: int = 256,
    ) -> None:
        super().__init__(
            tokenizer,
            vocab_size,
            disable_any_whitespace=disable_any_whitespace,
            disable_additional_properties=disable_additional_properties,
            max_rollback_tokens=max_rollback_tokens,
        )
        self.ll_tokenizer = llguidance_tokenizer(tokenizer, vocab_size)
        self._words = bitmask_words(vocab_size)
        self._cache_size = cache_size
        # (kind, spec) -> a matcher in its initial state, deep-copied for each request.
        self._templates: OrderedDict[tuple[StructuredOutputOptions, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def _options(self) -> dict[str, bool]:
        return {
            "disable_any_whitespace": self.disable_any_whitespace,
            "disable_additional_properties": self.disable_additional_properties,
        }

    def compile_grammar(self, kind: StructuredOutputOptions, spec: str) -> GuidanceGrammar:
        import llguidance as llg

        key = (kind, spec)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
        hit = template is not None
        if template is None:
            grammar = guidance_grammar(kind, spec, **self._options())
            template = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise _error(kind, template.get_error())
            for warning in template.get_grammar_warnings():
                logger.debug("llguidance warning for %s: %s", _KIND_NAMES[kind], warning)
            with self._lock:
                self._templates[key] = template
                while len(self._templates) > self._cache_size:
                    self._templates.popitem(last=False)
        self._count(hit=hit)
        return GuidanceGrammar(template.deep_copy(), self.eos_token_id, self._words)

    def validate(self, kind: StructuredOutputOptions, spec: str) -> None:
        validate_guidance_spec(kind, spec, tokenizer=self.ll_tokenizer, **self._options())

    def destroy(self) -> None:
        with self._lock:
            self._templates.clear()
