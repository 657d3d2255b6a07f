"""Tests for SentencePiece GGUF vocabularies (`tokenizer.ggml.model == "llama"`) in
`pagedinfer.tokenizer.Tokenizer.from_gguf`.

- Gemma 3 270M's file: encode (with and without BOS), decode (with and without special tokens)
  and round trips equal transformers' GGUF tokenizer of the same file on a few hundred strings
  generated here (scripts, whitespace, emoji, byte fallback, special tokens in text). Loading
  transformers' 262k-token tokenizer takes ~20 s, so it is built once per module.
- Tiny SentencePiece files written with gguf's GGUFWriter (Llama-, Gemma- and Phi-3-style
  pipelines; add_bos true/false/absent, add_space_prefix true/false, merges listed or rebuilt
  from scores) against transformers on the same files.
- The output path's `IncrementalDetokenizer` ends with `decode`'s text, byte-fallback characters
  split across steps included; unsupported tokenizer models are refused by name.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from pagedinfer.engine.detokenizer import IncrementalDetokenizer
from pagedinfer.engine.logprobs import TokenTextCache
from pagedinfer.sampling_params import SamplingParams
from pagedinfer.tokenizer import Tokenizer

# No model hub in tests; set before anything imports transformers/huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"

GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>"]
GEMMA_ADDED = ["[multimodal]", "<unused7>", "<start_of_image>", "<table>", "</td>"]

# Hand-picked texts, one or more per kind of input the tokenizer must agree on.
FIXED_TEXTS = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple    inner     spaces",
    "tabs\tbetween\t\twords\t",
    "new\nlines\n\nand\n\n\nruns\n\n\n\n\n",
    "\r\nwindows\r\nline ends\r\n",
    " \n \t mixed \n\t whitespace \t\n ",
    "0",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "1,000,000 and 1e-9 and -42 and 0x1F",
    "Hello, world! (Really?) [yes] {no} <maybe> 'quoted' \"double\" `tick`",
    "!@#$%^&*()_+-=[]{}|;':\",./<>?~",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", i); }',
    '<div class="a">text</div><table><tr><td>1</td></tr></table>',
    "SELECT * FROM users WHERE id = 1;",
    "emoji 😀🤖🎉👍🏽",
    "family 👨‍👩‍👧‍👦 and flag 🏳️‍🌈 and 🧑🏿‍💻 and 🇯🇵🇫🇷",
    "❤️ ❤ ✔️ ☕",
    "你好世界，今天天气很好。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트 안녕하세요",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Как дела?",
    "สวัสดีชาวโลก ภาษาไทย",
    "Ελληνικά γράμματα",
    "עברית טקסט",
    "Crème brûlée, naïve café, Ångström, Łódź, Dvořák, São Paulo",
    "Tiếng Việt có dấu: Xin chào thế giới!",
    "mixed English 中文 العربية हिन्दी 😀 123",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nhi<end_of_turn>",
    "text<eos>after eos<pad><pad>",
    "<start_of_turn> spaced <end_of_turn> ",
    "[multimodal] and <start_of_image> and <unused7>",
    "<start_of_turn",
    "start_of_turn>",
    "rare CJK \U00020000\U0002a6d6\U00030000 extension",
    "noncharacters \uffff\ufffe and \ufff0",
    "private use \ue000\U000f0000 and tags \U000e0041\U000e007f",
    "lone \u0378 unassigned and \U0001fbf9",
    "combining e\u0301 a\u0308 and NFC \u00e9",
    "zero width \u200b joiner \u200d nbsp \u00a0 ideographic \u3000 thin \u2009",
    "\x00\x01\x7f control bytes",
    "a" * 200,
    "ab " * 60,
    "\n" * 40,
    " " * 40,
    "\t" * 35,
]

# Character pools for the generated texts.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    " \t\n\r\u00a0\u3000",
    "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿĀāĄąĆćČčĘęĞğİıŁłŃńŌōŐőŒœŘřŚśŠšŢţŪūŮůŸŹźŻżŽž",
    "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЖЗИЙ",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着",
    "あいうえおかきくけこアイウエオカキクケコ",
    "مرحبابالعالمالعربية",
    "नमस्तेदुनियाहिन्दीभाषा",
    "สวัสดีชาวโลกภาษาไทย",
    "😀🤖🎉👍🏽❤️🇯🇵🔥✨🙏",
    "\U00020000\U0002a6d6\U00030000\uffff\ue000\U000e0041\u0378",
]


def _generated_texts(count: int, seed: int = 1234) -> list[str]:
    """Random mixes of 1-4 runs drawn from POOLS, sometimes with special tokens and emoji
    sequences between them."""
    rng = random.Random(seed)
    between = ["", " ", "  ", "\n", "\t", " \n", "\n\n"]
    pieces = [*GEMMA_SPECIALS, *GEMMA_ADDED, "👨‍👩‍👧", "🏳️‍🌈", "\n\n\n", "    "]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.15:
                parts.append(rng.choice(pieces))
            else:
                pool = rng.choice(POOLS)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 12))))
            parts.append(rng.choice(between))
        texts.append("".join(parts))
    return texts


GEMMA_TEXTS = FIXED_TEXTS + _generated_texts(260)


def _is_plain(text: str, specials: list[str]) -> bool:
    """Text that should read back as itself: no special-token strings and no "▁"."""
    return "\u2581" not in text and not any(s in text for s in specials)


# ---- Gemma 3 270M vs transformers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from pagedinfer.gguf_metadata import find_gemma3_270m

    try:
        return find_gemma3_270m()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gemma(gemma_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_path)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path: str) -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path)
    )


def test_gemma_encode_decode_match_transformers(gemma: Tokenizer, hf_gemma: Any) -> None:
    assert len(GEMMA_TEXTS) >= 300
    specials = [*GEMMA_SPECIALS, "<unused7>", "<unk>"]
    for text in GEMMA_TEXTS:
        with_bos = gemma.encode(text)
        assert with_bos == hf_gemma.encode(text), text
        ids = gemma.encode(text, add_special_tokens=False)
        assert ids == hf_gemma.encode(text, add_special_tokens=False), text
        assert with_bos == [gemma.bos_token_id, *ids]
        for skip in (False, True):
            for seq in (ids, with_bos):
                assert gemma.decode(seq, skip_special_tokens=skip) == hf_gemma.decode(
                    seq, skip_special_tokens=skip
                ), text
        assert gemma.convert_ids_to_tokens(ids) == hf_gemma.convert_ids_to_tokens(ids)
        # Gemma adds no prefix space and keeps every byte, so plain text reads back as itself.
        if _is_plain(text, specials):
            assert gemma.decode(ids) == gemma.decode(with_bos) == text


def test_gemma_vocabulary_and_special_tokens(gemma: Tokenizer, hf_gemma: Any) -> None:
    assert gemma.vocab_size == len(hf_gemma) == 262144
    assert gemma.backend.get_vocab() == hf_gemma.backend_tokenizer.get_vocab()
    assert (gemma.bos_token_id, gemma.eos_token_id) == (2, 1)
    assert (gemma.pad_token_id, gemma.unk_token_id) == (0, 3)
    assert gemma.add_bos_token and not gemma.add_eos_token
    assert gemma.all_special_ids == set(hf_gemma.all_special_ids) | {
        i for i, t in hf_gemma.added_tokens_decoder.items() if t.special
    }
    assert gemma.token_text(gemma.bos_token_id) == "<bos>"
    # A control token in text is one id; USER_DEFINED tokens (newline runs, html tags) are
    # whole too, but are text: skip_special_tokens keeps them.
    ids = gemma.encode("<start_of_turn>user\n\nhi<table><end_of_turn>", add_special_tokens=False)
    assert gemma.convert_ids_to_tokens(ids) == [
        "<start_of_turn>",
        "user",
        "\n\n",
        "hi",
        "<table>",
        "<end_of_turn>",
    ]
    assert gemma.decode(ids) == "user\n\nhi<table>"
    # The file spells space runs with real spaces; they are reachable as "▁▁".
    assert gemma.convert_ids_to_tokens(gemma.encode("a  b", add_special_tokens=False)) == [
        "a",
        "\u2581\u2581",
        "b",
    ]
    # A character outside the vocabulary falls back to its UTF-8 bytes.
    assert gemma.convert_ids_to_tokens(gemma.encode("\U00020000", add_special_tokens=False)) == [
        "<0xF0>",
        "<0xA0>",
        "<0x80>",
        "<0x80>",
    ]


# ---- streaming detokenisation -------------------------------------------------------------------

STREAM_TEXTS = [
    "Hello there, how are you today?",
    " leading space and   runs   of spaces",
    "rare \U00020000\U0002a6d6 chars and \uffff then 😀👨‍👩‍👧‍👦 emoji",
    "\U00020000\U00020001\U00020002",
    "日本語 and 中文 mixed with English words",
    "line\n\nbreaks\tand tabs",
    "reply<end_of_turn>\n<start_of_turn>user\nmore",
]


def _stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunk: int, skip: bool) -> str:
    det = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
    for start in range(0, len(ids), chunk):
        det.update(ids[start : start + chunk], False, finished=start + chunk >= len(ids))
    return det.output_text


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_gemma_streaming_matches_decode(gemma: Tokenizer, chunk: int) -> None:
    prompt = gemma.encode("<start_of_turn>user\nSay something<end_of_turn>\n<start_of_turn>model\n")
    for text in STREAM_TEXTS:
        ids = gemma.encode(text, add_special_tokens=False)
        for skip in (True, False):
            expected = gemma.decode(ids, skip_special_tokens=skip)
            assert _stream(gemma, prompt, ids, chunk, skip) == expected, text
            assert _stream(gemma, [], ids, chunk, skip) == expected, text
    # A prompt that ends inside a byte-fallback character still primes cleanly.
    broken = gemma.encode("Tell me: \U00020000")[:-2]
    ids = gemma.encode(" fine \U00020000", add_special_tokens=False)
    assert _stream(gemma, broken, ids, chunk, True) == " fine \U00020000"


def test_gemma_token_text_for_logprobs(gemma: Tokenizer) -> None:
    """Logprob token texts: the "▁" marker reads as a space; a lone byte token is U+FFFD."""
    cache = TokenTextCache(gemma)
    world = gemma.encode(" world", add_special_tokens=False)
    byte = gemma.encode("\U00020000", add_special_tokens=False)[0]
    assert cache([*world, byte, gemma.bos_token_id]) == [" world", "\ufffd", "<bos>"]


# ---- tiny SentencePiece GGUF files --------------------------------------------------------------

# (spelling, score) of the normal pieces; higher scores merge first.
_PIECES = [
    ("\u2581", -1.0),
    ("h", -2.0),
    ("e", -2.1),
    ("l", -2.2),
    ("o", -2.3),
    ("w", -2.4),
    ("r", -2.5),
    ("d", -2.6),
    ("he", -3.0),
    ("ll", -3.1),
    ("llo", -3.2),
    ("hello", -3.3),
    ("\u2581hello", -3.4),
    ("\u2581w", -3.5),
    ("or", -3.6),
    ("\u2581wor", -3.7),
    ("\u2581world", -3.8),
    ("ld", -3.9),
    ("\u2581\u2581", -4.0),
    ("\u2581h", -4.5),
    ("é", -5.0),
]


def _tiny_sp_gguf(
    path: Path,
    arch: str,
    add_bos: bool | None,
    add_space_prefix: bool,
    with_merges: bool = False,
) -> Path:
    """A SentencePiece vocabulary in llama.cpp's layout: named special tokens, a control and a
    user-defined token, an unused one, the 256 byte tokens, then scored pieces.

    The special names are the ones transformers' tokenizer class for `arch` presets (otherwise
    it appends them as new ids); Gemma's also has its all-space token written with spaces.
    """
    gguf = pytest.importorskip("gguf", reason="gguf's writer builds the tiny test file")
    if arch.startswith("gemma"):
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3)]
        bos, eos, unk, pad = 2, 1, 3, 0
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
        bos, eos, unk, pad = 1, 2, 0, None
    head += [("<start_of_turn>", 3), ("<think>", 4), ("<unused0>", 5)]
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in head] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = list(_PIECES)
    if arch.startswith("gemma"):
        pieces.remove(("\u2581\u2581", -4.0))
        pieces.append(("  ", -4.0))  # llama.cpp writes Gemma's space runs with spaces
    tokens += [t for t, _ in pieces]
    types += [4 if t == "  " else 1 for t, _ in pieces]
    scores += [s for _, s in pieces]

    writer = gguf.GGUFWriter(str(path), arch)
    # Just enough architecture keys for transformers to build a config from the file.
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if with_merges:
        # A deliberately different order than the scores imply: "▁w"+"or" before "▁"+"w".
        writer.add_token_merges(
            ["h e", "l l", "ll o", "he llo", "\u2581 hello", "o r", "l d", "\u2581 w"]
        )
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(unk)
    if pad is not None:
        writer.add_pad_token_id(pad)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


TINY_TEXTS = [
    "",
    " ",
    "  ",
    "hello world",
    "hello  world",
    " hello world",
    "  hello world ",
    "helloworld",
    "hello\nworld",
    "héllo wörld",
    "x",
    "🤖 hello",
    "\U00020000",
    "<start_of_turn>hello<think> world",
    "<s>hello</s>",
    "<unk> hello <pad><mask><bos><eos>",
    "<start_of_turn> hello",
    "hello<start_of_turn>",
    "<unused0>",
    "\u2581hello",
]


def _tiny_texts() -> list[str]:
    rng = random.Random(7)
    words = ["hello", "world", "he", "ll", "o", "é", "x", "🤖", "<think>", "<start_of_turn>"]
    gaps = ["", " ", "  ", "\n", "\t"]
    texts = list(TINY_TEXTS)
    for _ in range(60):
        n = rng.randint(1, 5)
        texts.append("".join(rng.choice(gaps) + rng.choice(words) for _ in range(n)))
    return texts


TINY_CASES = [
    # arch, add_bos (None: key absent), add_space_prefix, merges listed in the file
    ("llama", True, True, False),
    ("llama", False, False, False),
    ("llama", None, True, False),
    ("llama", True, True, True),
    ("gemma3", True, False, False),
    ("gemma3", False, True, False),
    ("phi3", True, True, False),
]


@pytest.mark.parametrize(("arch", "add_bos", "add_space_prefix", "with_merges"), TINY_CASES)
def test_tiny_sentencepiece_matches_transformers(
    tmp_path: Path, arch: str, add_bos: bool | None, add_space_prefix: bool, with_merges: bool
) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    path = _tiny_sp_gguf(tmp_path / "t.gguf", arch, add_bos, add_space_prefix, with_merges)
    tok = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert tok.vocab_size == len(hf) == len(hf.backend_tokenizer.get_vocab())
    assert tok.add_bos_token == (add_bos is not False)  # a missing flag means BOS
    for text in _tiny_texts():
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        plain = tok.encode(text, add_special_tokens=False)
        assert plain == hf.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text


def test_tiny_sentencepiece_pipelines(tmp_path: Path) -> None:
    llama = Tokenizer.from_gguf(_tiny_sp_gguf(tmp_path / "l.gguf", "llama", True, True))
    gemma = Tokenizer.from_gguf(_tiny_sp_gguf(tmp_path / "g.gguf", "gemma3", True, False))
    # Llama: "▁" is prepended to the text (once), and decode drops it again.
    assert llama.convert_ids_to_tokens(llama.encode("hello world")) == [
        "<s>",
        "\u2581hello",
        "\u2581world",
    ]
    assert llama.decode(llama.encode("hello world")) == "hello world"
    # ...but not after a special token, and not doubled before a leading space.
    assert llama.convert_ids_to_tokens(llama.encode("<start_of_turn>hello", False)) == [
        "<start_of_turn>",
        "hello",
    ]
    assert llama.convert_ids_to_tokens(llama.encode(" hello", False)) == ["\u2581hello"]
    # Gemma: no prefix; the file's "  " token is reachable as "▁▁".
    assert gemma.convert_ids_to_tokens(gemma.encode("hello  ", False)) == ["hello", "\u2581\u2581"]
    # Byte fallback for characters outside the vocabulary, in both.
    for tok in (llama, gemma):
        ids = tok.encode("🤖", add_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]
        assert tok.decode(ids) == "🤖"
        assert tok.unk_token_id in tok.all_special_ids
        assert tok.vocab_size == 6 + 256 + len(_PIECES) + (2 if tok is gemma else 0)


def test_tiny_llama_streaming_matches_decode(tmp_path: Path) -> None:
    """Llama's decoder strips one leading space: without a prompt the stream does too; after a
    prompt, the output's first "▁" is a space, as in decoding prompt and output together."""
    tok = Tokenizer.from_gguf(_tiny_sp_gguf(tmp_path / "l.gguf", "llama", True, True))
    prompt = tok.encode("hello")
    for text in ["hello world 🤖 héllo", "🤖🤖 x \U00020000", "world<start_of_turn>hello"]:
        ids = tok.encode(text, add_special_tokens=False)
        for chunk in (1, 2):
            assert _stream(tok, [], ids, chunk, True) == tok.decode(ids), text
            full = tok.decode(prompt + ids)
            assert _stream(tok, prompt, ids, chunk, True) == full[len(tok.decode(prompt)) :]


# ---- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "rwkv", "t5"])
def test_unsupported_tokenizer_model_is_refused(tmp_path: Path, model: str) -> None:
    gguf = pytest.importorskip("gguf", reason="gguf's writer builds the tiny test file")
    path = tmp_path / "u.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match=rf"'{model}' is not supported \(supported: 'gpt2' .*, 'llama' "
    ):
        Tokenizer.from_gguf(path)
