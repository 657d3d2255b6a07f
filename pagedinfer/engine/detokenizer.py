"""Incremental detokenization of generated tokens, and stop-string detection.

Role: the front end turns the token ids that the engine core streams back into text, one
request at a time, without re-decoding the whole output at every step. `IncrementalDetokenizer`
wraps `tokenizers.decoders.DecodeStream`, which decodes a short sliding window of ids and only
emits text once it no longer ends in an incomplete UTF-8 sequence (U+FFFD).

Invariants:
- `output_text == tokenizer.decode(output ids, skip_special_tokens)` for ordinary text,
  including characters whose bytes are split across tokens, except that (a) a matched stop
  string truncates the text and (b) a final stop *token* is not decoded unless
  `include_stop_str_in_output`.
- The stream is primed with a short prompt suffix whose text is clean (no U+FFFD), so the first
  output token is decoded in context (e.g. SentencePiece's leading space survives).
- While a request runs, `get_next_output_text` withholds the last `output_text_buffer_length`
  characters, so a partially generated stop string never reaches the user.
- Stop strings are searched only in the tail that the newest characters could complete, so the
  cost per step does not grow with the output length.

Callers: `engine.output_processor.RequestState` (one detokenizer per engine-core request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from pagedinfer.core.messages import EngineCoreRequest
from pagedinfer.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "TokenizerLike", "check_stop_strings"]

_REPLACEMENT_CHAR = "\ufffd"
# Prompt-suffix lengths tried for priming: long enough to give the decoder context, short enough
# that priming stays cheap for long prompts.
_MIN_PRIME_TOKENS = 4
_MAX_PRIME_TOKENS = 24
# Already-decoded output ids remembered as context for the fallback/flush decode paths.
_CONTEXT_TOKENS = 8


class TokenizerLike(Protocol):
    """The part of `pagedinfer.tokenizer.Tokenizer` that the output path uses."""

    @property
    def backend(self) -> BackendTokenizer: ...

    @property
    def all_special_ids(self) -> set[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that the last `new_char_count` characters completed.

    Returns `(stop_string, truncate_to)`: the text must be cut to `output_text[:truncate_to]`
    (the match start, or its end if `include_in_output`). The first stop string in `stop`
    order that matches wins, even if another one matches earlier in the text (vLLM semantics).
    Only the tail that could contain a newly completed match is searched: an occurrence that
    ended before the new characters would have been found by an earlier call.
    """
    if new_char_count <= 0 or not stop:
        return None
    text_len = len(output_text)
    for stop_str in stop:
        start = max(0, text_len - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index < 0:
            continue
        return stop_str, index + len(stop_str) if include_in_output else index
    return None


class IncrementalDetokenizer:
    """Detokenizes one request's output ids incrementally and checks its stop strings.

    With `tokenizer=None` or `detokenize=False` it only tracks token ids and the text stays "".
    """

    def __init__(
        self,
        tokenizer: TokenizerLike | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        self.buffer_length = params.output_text_buffer_length
        self._last_output_offset = 0  # end of the text already returned in DELTA mode
        self._backend: BackendTokenizer | None = None
        # None when not detokenizing, or after a stream failure (then `_step` decodes itself).
        self._stream: DecodeStream | None = None
        # Ids fed to the stream since it last produced text (an incomplete character).
        self._pending: list[int] = []
        # A few ids whose text is final: context for decoding `_pending` outside the stream.
        self._context: list[int] = []
        if tokenizer is not None and params.detokenize:
            self._backend = tokenizer.backend
            self._context = self._clean_suffix(prompt_token_ids)
            self._stream = self._new_stream(self._context)

    @classmethod
    def from_request(
        cls, tokenizer: TokenizerLike | None, request: EngineCoreRequest
    ) -> IncrementalDetokenizer:
        return cls(tokenizer, request.prompt_token_ids, request.sampling_params)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool, finished: bool = False
    ) -> str | None:
        """Append new ids, decode them, and return the stop string they completed, if any.

        `stop_terminated`: the engine core finished the request on a stop token (EOS or
        `stop_token_ids`); that last token is kept in `token_ids` but not decoded unless
        `include_stop_str_in_output`. `finished` (or `stop_terminated`): this is the last
        update, so bytes still held back as an incomplete character are flushed as U+FFFD,
        exactly as a full decode would show them.
        On a stop-string match the text is truncated and the stop string returned; the caller
        must finish the request.
        """
        self.token_ids.extend(new_token_ids)
        if self._backend is None:
            return None
        to_decode = list(new_token_ids)
        if stop_terminated and to_decode and not self.include_stop_str_in_output:
            to_decode.pop()
        pieces: list[str] = []
        for token_id in to_decode:
            piece = self._step(token_id)
            if piece:
                pieces.append(piece)
        if (finished or stop_terminated) and self._pending:
            pieces.append(self._flush())
        new_text = "".join(pieces)
        self.output_text += new_text

        # Stop strings are ignored until min_tokens were generated (like stop tokens).
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(
            self.output_text, len(new_text), self.stop, self.include_stop_str_in_output
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now: everything (or, if `delta`, what is new since the last call),
        minus the hold-back tail while the request is still running."""
        hold = 0 if finished else self.buffer_length
        end = max(0, len(self.output_text) - hold)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_offset
        if end <= start:
            return ""
        self._last_output_offset = end
        return self.output_text[start:end]

    # ----------------------------------------------------------------------------- internals

    def _decode(self, ids: list[int]) -> str:
        assert self._backend is not None
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _new_stream(self, prime_ids: list[int]) -> DecodeStream:
        return DecodeStream(ids=prime_ids or None, skip_special_tokens=self.skip_special_tokens)

    def _clean_suffix(self, ids: Sequence[int]) -> list[int]:
        """Shortest suffix of `ids` (4..24 tokens, or all of a shorter list) whose text has no
        U+FFFD; [] if none. A suffix that starts or ends inside a character would make the
        stream's prefix text disagree with later decodes."""
        if not ids:
            return []
        lo = min(_MIN_PRIME_TOKENS, len(ids))
        hi = min(_MAX_PRIME_TOKENS, len(ids))
        for n in range(lo, hi + 1):
            suffix = list(ids[-n:])
            if _REPLACEMENT_CHAR not in self._decode(suffix):
                return suffix
        return []

    def _step(self, token_id: int) -> str | None:
        assert self._backend is not None
        if self._stream is not None:
            try:
                piece: str | None = self._stream.step(self._backend, token_id)
            # tokenizers raises a bare Exception when the stream's window decodes inconsistently
            # (rare; decoders that rewrite text across token boundaries). Finish this request
            # on the pure-Python path below, which runs the same algorithm on our own context.
            except Exception:  # noqa: BLE001
                self._stream = None
            else:
                if piece is None:
                    self._pending.append(token_id)
                else:
                    self._context = (self._context + self._pending + [token_id])[-_CONTEXT_TOKENS:]
                    self._pending = []
                return piece
        self._pending.append(token_id)
        text = self._decode_pending()
        if text.endswith(_REPLACEMENT_CHAR):
            return None  # an incomplete character: wait for its remaining bytes
        self._commit_pending()
        return text

    def _flush(self) -> str:
        """Emit `_pending` as is (incomplete characters become U+FFFD, as in a full decode)."""
        text = self._decode_pending()
        self._commit_pending()
        return text

    def _decode_pending(self) -> str:
        """Text that `_pending` adds after `_context` (decoded together, so that decoders that
        depend on the previous token, like SentencePiece's leading space, see it)."""
        full = self._decode(self._context + self._pending)
        prefix = self._decode(self._context)
        return full[len(prefix) :] if full.startswith(prefix) else self._decode(self._pending)

    def _commit_pending(self) -> None:
        self._context = (self._context + self._pending)[-_CONTEXT_TOKENS:]
        self._pending = []
