"""The grammar-backend interface of structured outputs (guided decoding).

Role: the engine keeps one `StructuredOutputBackend` per engine (made by `create_backend`) and
asks it for one `StructuredOutputGrammar` per structured request. Each step the engine has every
such grammar write the set of allowed next tokens into its row of a shared int32 bitmask
(`fill_bitmask`), the sampler masks the logits with it (`apply_token_bitmask`), and the sampled
tokens are fed back (`accept_tokens`). Two implementations sit behind the interface: xgrammar
(`backend_xgrammar`, the default) and llguidance (`backend_guidance`). `resolve_auto_backend`
picks one for the "auto" mode: xgrammar when it can take the spec, else llguidance.

Bitmask layout (both libraries'): int32 [rows, ceil(vocab_size / 32)]; bit j (LSB first) of word
w allows token 32 * w + j. `vocab_size` is the model's (LM head rows); ids past the tokenizer's
vocabulary are never allowed, and bits past `vocab_size` in the last word mean nothing.

Termination: the EOS token is allowed exactly when the text so far is a complete match. EOS is
handled here rather than in the libraries (whose EOS bookkeeping differs): accepting it sets
`is_terminated()`, after which only EOS is allowed and no token is accepted; rolling back over
it clears the flag.

What a spec is (its kinds and strings) and the parsing both backends share are in `specs`.
"""

from __future__ import annotations

import sys
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Literal

import torch

from pagedinfer.extras import missing_modules
from pagedinfer.structured_output.specs import (
    StructuredOutputOptions,
    StructuredOutputSpecError,
    grammar_is_lark,
)

if TYPE_CHECKING:
    from pagedinfer.tokenizer import Tokenizer

__all__ = [
    "BackendName",
    "MatcherGrammar",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "allow_only",
    "apply_token_bitmask",
    "bitmask_words",
    "create_backend",
    "grammar_accepts_text",
    "resolve_auto_backend",
]


BackendName = Literal["xgrammar", "guidance"]


def bitmask_words(vocab_size: int) -> int:
    """Width in int32 words of a bitmask row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


# ---- interface ---------------------------------------------------------------------------------


class StructuredOutputGrammar(ABC):
    """The matching state of one structured request."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over `tokens`. If one is not allowed, return False and change nothing."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` that could be accepted now; the state is unchanged."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (an accepted EOS counts as one)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, on CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether EOS has been accepted."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state (nothing accepted)."""


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` of a packed int32 bitmask allows `token_id` alone."""
    bitmask[row].zero_()
    word, bit = divmod(token_id, 32)
    value = 1 << bit
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class MatcherGrammar(StructuredOutputGrammar):
    """A `StructuredOutputGrammar` over a library matcher, with EOS kept out of the library.

    Subclasses provide the library primitives, on non-EOS tokens only: `_try_advance` (all or
    nothing), `_count_valid`, `_can_end`, `_lib_rollback`, `_lib_reset` and `_fill`.
    """

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.num_processed_tokens = 0  # non-EOS tokens the library holds
        self._terminated = False

    # -- primitives --
    @abstractmethod
    def _try_advance(self, tokens: list[int]) -> bool:
        """Advance over all `tokens` (no EOS) or, returning False, over none."""

    @abstractmethod
    def _count_valid(self, tokens: list[int]) -> int:
        """How many leading `tokens` (no EOS) could be accepted; the state is unchanged."""

    @abstractmethod
    def _can_end(self) -> bool:
        """Whether the text matched so far is complete (EOS allowed)."""

    @abstractmethod
    def _lib_rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def _lib_reset(self) -> None: ...

    @abstractmethod
    def _fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    # -- interface --
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if not tokens:
            return True
        if self._terminated:
            return False
        eos = self.eos_token_id
        body = list(tokens)
        ends = body[-1] == eos
        if ends:
            body.pop()
        if eos in body:  # nothing may follow EOS
            return False
        if body and not self._try_advance(body):
            return False
        if ends and not self._can_end():
            if body:
                self._lib_rollback(len(body))
            return False
        self.num_processed_tokens += len(body)
        self._terminated = ends
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        if self._terminated or not tokens:
            return []
        tokens = list(tokens)
        k = tokens.index(self.eos_token_id) if self.eos_token_id in tokens else len(tokens)
        body = tokens[:k]
        n = self._count_valid(body) if body else 0
        if n < k or k == len(tokens):
            return tokens[:n]
        # A fully valid body followed by EOS: is the text complete after the body?
        if not body:
            return tokens[:1] if self._can_end() else []
        if not self._try_advance(body):  # cannot happen after _count_valid said all valid
            return []
        try:
            can_end = self._can_end()
        finally:
            self._lib_rollback(len(body))
        return tokens[: k + 1] if can_end else body

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        held = self.num_processed_tokens + int(self._terminated)
        if num_tokens > held:
            raise ValueError(f"cannot roll back {num_tokens} tokens, only {held} were accepted")
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._lib_rollback(num_tokens)
            self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            allow_only(bitmask, row, self.eos_token_id)
        else:
            self._fill(bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._lib_reset()
        self.num_processed_tokens = 0
        self._terminated = False


class StructuredOutputBackend(ABC):
    """Compiles specs into grammars for one tokenizer and model vocabulary.

    Options: `disable_any_whitespace` makes JSON compact (no optional whitespace, separators
    "," and ":"); `disable_additional_properties` treats object schemas that list properties
    without saying `additionalProperties` as `additionalProperties: false`.
    `max_rollback_tokens` is kept for the engine (speculative decoding); both libraries keep an
    unlimited history in the versions we use, so it is not a limit here.

    Compiled specs are cached per backend; `num_compiles` and `num_cache_hits` count them.
    `compile_grammar` may be called from several threads.
    """

    name: BackendName

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        disable_any_whitespace: bool = False,
        disable_additional_properties: bool = False,
        max_rollback_tokens: int = 0,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if tokenizer.eos_token_id is None:
            raise ValueError("structured output needs a tokenizer with an EOS token")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties
        self.max_rollback_tokens = max_rollback_tokens
        self.num_compiles = 0
        self.num_cache_hits = 0
        self._stats_lock = threading.Lock()

    def _count(self, *, hit: bool) -> None:
        with self._stats_lock:
            if hit:
                self.num_cache_hits += 1
            else:
                self.num_compiles += 1

    @abstractmethod
    def compile_grammar(self, kind: StructuredOutputOptions, spec: str) -> StructuredOutputGrammar:
        """A fresh grammar for the spec; ValueError naming the problem if it is invalid or this
        backend cannot take it."""

    @abstractmethod
    def validate(self, kind: StructuredOutputOptions, spec: str) -> None:
        """ValueError with a clear message if `compile_grammar` would reject the spec; cheaper
        than compiling where the library allows."""

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """int32 [max_num_seqs, ceil(vocab_size / 32)], all bits set (everything allowed)."""
        return torch.full(
            (max_num_seqs, bitmask_words(self.vocab_size)), -1, dtype=torch.int32, device="cpu"
        )

    def destroy(self) -> None:
        """Drop cached compilations."""


_BACKEND_LIBRARIES: dict[str, str] = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def require_backend_library(name: str) -> None:
    """ValueError (a 400 on the server, for that request alone) when the backend's library is
    not installed: both come with the `guided` extra."""
    library = _BACKEND_LIBRARIES.get(name)
    if library is not None and missing_modules(library):
        raise ValueError(
            f"the {name} structured output backend needs {library!r}, which is not installed: "
            "pip install 'pagedinfer[guided]'"
        )


def create_backend(
    name: BackendName,
    tokenizer: Tokenizer,
    vocab_size: int,
    **opts: Any,
) -> StructuredOutputBackend:
    """The backend called `name` ("xgrammar" or "guidance"); options as in
    `StructuredOutputBackend`. Resolve "auto" per request with `resolve_auto_backend`."""
    require_backend_library(name)
    if name == "xgrammar":
        from pagedinfer.structured_output.backend_xgrammar import XgrammarBackend

        return XgrammarBackend(tokenizer, vocab_size, **opts)
    if name == "guidance":
        from pagedinfer.structured_output.backend_guidance import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, **opts)
    raise ValueError(f"unknown structured output backend {name!r} (xgrammar or guidance)")


def grammar_accepts_text(
    backend: StructuredOutputBackend,
    tokenizer: Tokenizer,
    kind: StructuredOutputOptions,
    spec: str,
    text: str,
) -> bool:
    """Whether a fresh grammar for `spec` takes `text` (its tokens) to an end: every token
    accepted, then terminated or EOS allowed. For measuring what a backend enforces
    (tests/unit/structured_output/test_keyword_routing.py, benchmarks/bench_schema_coverage.py)."""
    grammar = backend.compile_grammar(kind, spec)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.accept_tokens("probe", [token]):
            return False
    if grammar.is_terminated():
        return True
    mask = backend.allocate_token_bitmask(1)
    mask.fill_(0)
    grammar.fill_bitmask(mask, 0)
    eos = tokenizer.eos_token_id
    assert eos is not None
    return bool((int(mask[0, eos // 32]) >> (eos % 32)) & 1)


def resolve_auto_backend(
    kind: StructuredOutputOptions,
    spec: str,
    *,
    disable_any_whitespace: bool = False,
    disable_additional_properties: bool = False,
) -> BackendName:
    """The backend for a spec in "auto" mode: xgrammar if it can take the spec, else guidance
    (llguidance); Lark grammars go to guidance. ValueError, with both reasons, if neither can.

    The check is tokenizer-free (xgrammar's front-end parsers, llguidance's grammar validator).
    """
    require_backend_library("xgrammar")
    require_backend_library("guidance")
    from pagedinfer.structured_output.backend_guidance import validate_guidance_spec
    from pagedinfer.structured_output.backend_xgrammar import validate_xgrammar_spec

    opts = {
        "disable_any_whitespace": disable_any_whitespace,
        "disable_additional_properties": disable_additional_properties,
    }
    if kind is StructuredOutputOptions.GRAMMAR and grammar_is_lark(spec):
        validate_guidance_spec(kind, spec, **opts)
        return "guidance"
    try:
        validate_xgrammar_spec(kind, spec, **opts)
        return "xgrammar"
    except ValueError as xgr_error:
        try:
            validate_guidance_spec(kind, spec, **opts)
        except ValueError as llg_error:
            raise StructuredOutputSpecError(
                f"no structured output backend can take this {kind.name.lower()} spec: "
                f"xgrammar: {xgr_error}; guidance: {llg_error}"
            ) from None
        return "guidance"


# ---- applying a bitmask ------------------------------------------------------------------------

_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place.

    logits: [n, vocab_size] float (float32, bfloat16, ...); bitmask: int32 [n, words] on the
    same device, bit j of word w allowing token 32 * w + j. Columns past 32 * words are
    disallowed; bits past vocab_size are ignored.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be 2-D "
            "with the same number of rows"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    rows, vocab = logits.shape
    covered = min(vocab, 32 * bitmask.shape[1])
    if covered < vocab:
        logits[:, covered:] = float("-inf")
    if rows == 0 or covered == 0:
        return
    device = bitmask.device
    if sys.byteorder == "little":
        # Little-endian: byte b of word w holds tokens 32w + 8b ... 32w + 8b + 7, so the byte
        # view in order unpacks to token order, on 1-byte temporaries.
        byte_bits = _BYTE_BITS.get(device)
        if byte_bits is None:
            byte_bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
            _BYTE_BITS[device] = byte_bits
        packed = bitmask.contiguous().view(torch.uint8)[:, : (covered + 7) // 8]
        disallowed = (packed.unsqueeze(-1) & byte_bits).eq(0)
    else:
        words = bitmask[:, : (covered + 31) // 32]
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        disallowed = ((words.unsqueeze(-1) >> shifts) & 1).eq(0)
    logits[:, :covered].masked_fill_(disallowed.reshape(rows, -1)[:, :covered], float("-inf"))
