"""Tests for `pagedinfer.engine.detokenizer`: incremental text == full decode, priming, stop
strings (tail search, list order, straddling tokens, inclusion), stop-token handling and the
streaming hold-back.

Uses the real SmolLM2 byte-level BPE tokenizer (pagedinfer's, read from the default GGUF),
wrapped into the small protocol the output path needs.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from pagedinfer.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from pagedinfer.sampling_params import SamplingParams

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EOS = 2  # <|im_end|>

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _Tok:
    """Stand-in for `pagedinfer.tokenizer.Tokenizer` over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: BackendTokenizer) -> None:
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = {i for i, tok in added.items() if tok.special}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def _load_smollm2_backend(config: pytest.Config) -> BackendTokenizer:
    # Our own GGUF tokenizer (tests/unit/test_tokenizer.py proves it encodes exactly like
    # transformers'); loading it takes ~0.3 s.
    from pagedinfer.gguf_metadata import find_default_model
    from pagedinfer.tokenizer import Tokenizer

    backend: BackendTokenizer = Tokenizer.from_gguf(find_default_model()).backend
    return backend


@pytest.fixture(scope="module")
def tok(pytestconfig: pytest.Config) -> _Tok:
    return _Tok(_load_smollm2_backend(pytestconfig))


PROMPT = "<|im_start|>user\nSay something nice.<|im_end|>\n<|im_start|>assistant\n"
TEXTS = [
    "Hello, world! How are you today?",
    " leading space and  double  spaces\n\nnew lines\ttabs",
    "Emoji: 😀👍🏽👨‍👩‍👧 done",
    "中文测试：你好，世界。日本語もテスト。",
    "Tiếng Việt có dấu: Nguyễn Trãi, phở, đường phố.",
    "def f(x):\n    return x ** 2  # code\n",
    "Ünïcödé ßtraße — “quotes” … ½ ∑ ∞",
]


def _detok(tok: _Tok, prompt: str = PROMPT, **kw: object) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(prompt), SamplingParams(**kw))  # type: ignore[arg-type]


def _feed(
    det: IncrementalDetokenizer, ids: list[int], chunk: int = 1, finish: bool = True
) -> str | None:
    """Feed ids in chunks; returns the first stop string hit (and stops there)."""
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        stop = det.update(ids[start : start + chunk], False, finished=finish and last)
        if stop is not None:
            return stop
    return None


# ------------------------------------------------------------------ incremental == full decode


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tok: _Tok, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    det = _detok(tok)
    _feed(det, ids, chunk)
    assert det.output_text == tok.decode(ids) == text
    assert det.token_ids == ids


@_SETTINGS
@given(text=st.text(min_size=1, max_size=40), chunk=st.integers(1, 4))
def test_random_text_roundtrips(tok: _Tok, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    det = _detok(tok)
    _feed(det, ids, chunk)
    assert det.output_text == tok.decode(ids)


@st.composite
def _vocab_ids(draw: st.DrawFn) -> list[int]:
    # Half the draws from the low ids, where the lone bytes and special tokens live, so that
    # split and invalid UTF-8 sequences are common.
    one = st.one_of(st.integers(0, 600), st.integers(0, 49151))
    return draw(st.lists(one, min_size=1, max_size=20))


@_SETTINGS
@given(ids=_vocab_ids(), chunk=st.integers(1, 3), skip=st.booleans())
def test_random_vocab_ids_match_full_decode(
    tok: _Tok, ids: list[int], chunk: int, skip: bool
) -> None:
    """Arbitrary id sequences (incl. invalid/partial UTF-8 and special tokens): every
    intermediate text is a prefix of the full decode, and the final text equals it."""
    det = _detok(tok, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    for start in range(0, len(ids), chunk):
        det.update(ids[start : start + chunk], False, finished=start + chunk >= len(ids))
        assert full.startswith(det.output_text)
    assert det.output_text == full


def test_split_character_is_held_until_complete(tok: _Tok) -> None:
    ids = tok.encode(" 😀")
    assert len(ids) > 1  # the emoji's bytes span tokens
    det = _detok(tok)
    det.update(ids[:1], False)
    assert "\ufffd" not in det.output_text
    det.update(ids[1:], False)
    assert det.output_text == " 😀"


def test_unfinished_partial_character_is_flushed_on_finish(tok: _Tok) -> None:
    ids = tok.encode(" 😀")[:-1]
    det = _detok(tok)
    det.update(ids, False)
    assert det.output_text == ""
    det.update([], False, finished=True)
    assert det.output_text == tok.decode(ids)
    assert det.output_text.endswith("\ufffd")


def test_special_tokens_kept_or_skipped(tok: _Tok) -> None:
    ids = [*tok.encode("Hi"), 1, *tok.encode("there")]
    det = _detok(tok, skip_special_tokens=False)
    _feed(det, ids)
    assert det.output_text == "Hi<|im_start|>there"
    det = _detok(tok, skip_special_tokens=True)
    _feed(det, ids)
    assert det.output_text == "Hithere"


def test_detokenize_false_only_tracks_ids(tok: _Tok) -> None:
    det = _detok(tok, detokenize=False)
    assert det.update(tok.encode("Hello world"), False, finished=True) is None
    assert det.output_text == ""
    assert det.token_ids == tok.encode("Hello world")
    assert det.get_next_output_text(True, False) == ""


class _BrokenStream:
    def step(self, tokenizer: object, token_id: int) -> str | None:
        raise Exception("Invalid prefix encountered")  # what tokenizers raises


def test_stream_failure_falls_back_to_context_decode(tok: _Tok) -> None:
    ids = tok.encode("Hello 世界 again")
    det = _detok(tok)
    det.update(ids[:2], False)
    det._stream = _BrokenStream()  # type: ignore[assignment]
    det.update(ids[2:3], False)  # fails inside the split "世": the fallback holds it too
    assert det.output_text == "Hello "
    det.update(ids[3:], False, finished=True)
    assert det.output_text == "Hello 世界 again"


@_SETTINGS
@given(ids=_vocab_ids(), skip=st.booleans())
def test_fallback_path_matches_full_decode(tok: _Tok, ids: list[int], skip: bool) -> None:
    det = _detok(tok, skip_special_tokens=skip)
    det._stream = _BrokenStream()  # type: ignore[assignment]
    full = tok.decode(ids, skip_special_tokens=skip)
    for i, token_id in enumerate(ids):
        det.update([token_id], False, finished=i == len(ids) - 1)
        assert full.startswith(det.output_text)
    assert det.output_text == full


# -------------------------------------------------------------------------------- priming


def _metaspace_tok() -> _Tok:
    """A word-level tokenizer whose decoder drops the leading space of the first token, like
    SentencePiece models: decoding the first output token alone would lose its space."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3, "!": 4}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return _Tok(backend)


def test_priming_keeps_first_token_leading_space() -> None:
    tok = _metaspace_tok()
    assert tok.decode([2]) == "world"  # alone, the space is gone
    prompt = [1, 1, 1, 4, 1]
    det = IncrementalDetokenizer(tok, prompt, SamplingParams())  # type: ignore[arg-type]
    det.update([2, 3], False)
    assert det.output_text == " world again"
    # Without a prompt there is no context, so the text equals the plain decode.
    det = IncrementalDetokenizer(tok, [], SamplingParams())  # type: ignore[arg-type]
    det.update([2, 3], False)
    assert det.output_text == tok.decode([2, 3]) == "world again"


def test_priming_skips_prompt_suffix_with_split_character(tok: _Tok) -> None:
    # The prompt ends inside an emoji: priming must pick a clean window (here: none inside
    # the broken tail), and the output must still decode on its own terms.
    prompt = tok.encode("Tell me: 😀")[:-1]
    det = IncrementalDetokenizer(tok, prompt, SamplingParams())  # type: ignore[arg-type]
    out = tok.encode(" fine, thanks 😀")
    _feed(det, out)
    assert det.output_text == " fine, thanks 😀"


# ----------------------------------------------------------------------------- stop strings


def test_check_stop_strings_basics() -> None:
    assert check_stop_strings("abcSTOP", 4, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("abcSTOP", 4, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abcSTOPxy", 3, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abcSTOP", 0, ["STOP"], False) is None
    assert check_stop_strings("abcSTOP", 3, [], False) is None
    # List order wins over position in the text.
    assert check_stop_strings("xAyB", 4, ["B", "A"], False) == ("B", 3)


def test_check_stop_strings_searches_only_the_tail() -> None:
    # "STOP" ended before the new characters, so an earlier call already had the chance.
    assert check_stop_strings("STOPabcdef", 3, ["STOP"], False) is None
    # A match straddling old and new characters is found.
    assert check_stop_strings("abcSTOP", 1, ["STOP"], False) == ("STOP", 3)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_straddling_tokens(tok: _Tok, include: bool) -> None:
    text = "The answer is forty-two. Goodbye now, friend."
    ids = tok.encode(text)
    det = _detok(tok, stop=["bye now"], include_stop_str_in_output=include)
    assert _feed(det, ids) == "bye now"
    expected = (
        "The answer is forty-two. Goodbye now" if include else "The answer is forty-two. Good"
    )
    assert det.output_text == expected
    assert len(det.token_ids) < len(ids)  # _feed stopped at the token that completed the match


@_SETTINGS
@given(
    text=st.text(st.characters(codec="utf-8"), min_size=2, max_size=30),
    data=st.data(),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_stop_string_anywhere(
    tok: _Tok, text: str, data: st.DataObject, include: bool, chunk: int
) -> None:
    ids = tok.encode(text)
    full = tok.decode(ids)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = full[start : start + data.draw(st.integers(1, 4))]
    det = _detok(tok, stop=[stop], include_stop_str_in_output=include)
    streamed: list[str] = []
    hit = None
    for i in range(0, len(ids), chunk):
        hit = det.update(ids[i : i + chunk], False, finished=i + chunk >= len(ids))
        if hit is not None:
            break
        streamed.append(det.get_next_output_text(finished=False, delta=False))
    assert hit == stop
    index = full.find(stop)
    assert det.output_text == full[: index + len(stop) if include else index]
    # Hold-back: nothing streamed before the stop was beyond what the final text keeps.
    for partial in streamed:
        assert det.output_text.startswith(partial)


def test_first_stop_string_in_list_order_wins(tok: _Tok) -> None:
    det = _detok(tok, stop=["world", "Hello"])
    # Both complete in the same update: list order picks "world" although "Hello" is earlier.
    assert det.update(tok.encode("Hello world"), False) == "world"
    assert det.output_text == "Hello "


def test_stop_strings_ignored_until_min_tokens(tok: _Tok) -> None:
    ids = tok.encode("a b a b a b")
    det = _detok(tok, stop=["a"], min_tokens=3)
    hits = [det.update([i], False) for i in ids[:3]]
    assert hits == [None, None, None]
    assert det.update([ids[3]], False) is None  # " b": no new "a"
    assert det.update([ids[4]], False) == "a"
    assert det.output_text == "a b a b "


# ------------------------------------------------------------------------------ stop tokens


@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_not_decoded_unless_included(tok: _Tok, skip: bool) -> None:
    ids = tok.encode("Done.")
    det = _detok(tok, skip_special_tokens=skip)
    det.update(ids, False)
    det.update([_EOS], True, finished=True)
    assert det.output_text == "Done."
    assert det.token_ids == [*ids, _EOS]

    det = _detok(tok, skip_special_tokens=skip, include_stop_str_in_output=True)
    det.update([*ids, _EOS], True, finished=True)
    assert det.output_text == ("Done." if skip else "Done.<|im_end|>")


def test_non_special_stop_token_is_cut(tok: _Tok) -> None:
    ids = tok.encode("One two three")
    det = _detok(tok, stop_token_ids=[ids[-1]])
    det.update(ids, True, finished=True)
    assert det.output_text == "One two"
    assert det.token_ids == ids


# --------------------------------------------------------------------------- hold-back / delta


def test_hold_back_and_delta(tok: _Tok) -> None:
    det = _detok(tok, stop=["END!"])
    assert det.buffer_length == 3
    det.update(tok.encode("Hello there"), False)
    assert det.get_next_output_text(finished=False, delta=False) == "Hello th"
    assert det.get_next_output_text(finished=False, delta=True) == "Hello th"
    assert det.get_next_output_text(finished=False, delta=True) == ""
    det.update(tok.encode(" friend"), False)
    assert det.get_next_output_text(finished=False, delta=True) == "ere fri"
    assert det.get_next_output_text(finished=True, delta=True) == "end"
    assert det.get_next_output_text(finished=True, delta=False) == "Hello there friend"


def test_no_hold_back_when_stop_string_included(tok: _Tok) -> None:
    det = _detok(tok, stop=["END!"], include_stop_str_in_output=True)
    det.update(tok.encode("Hello"), False)
    assert det.get_next_output_text(finished=False, delta=False) == "Hello"


@_SETTINGS
@given(text=st.text(min_size=1, max_size=40), chunk=st.integers(1, 4), stops=st.booleans())
def test_delta_concatenation_equals_cumulative(
    tok: _Tok, text: str, chunk: int, stops: bool
) -> None:
    ids = tok.encode(text)
    stop = ["\n", "xyz"] if stops else None
    det = _detok(tok, stop=stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        hit = det.update(ids[i : i + chunk], False, finished=last)
        done = last or hit is not None
        deltas.append(det.get_next_output_text(finished=done, delta=True))
        if hit is not None:
            break
    assert "".join(deltas) == det.output_text == det.get_next_output_text(True, False)
