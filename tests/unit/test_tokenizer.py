"""Tests for `pagedinfer.tokenizer.Tokenizer`: encodings and chat templates equal transformers'
GGUF tokenizer for the default model; round trips; special tokens; HF-directory save/load;
BOS post-processing and pre-tokenizer selection on a tiny GGUF vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tokenizers.decoders import DecodeStream

from pagedinfer.gguf_metadata import find_default_model
from pagedinfer.tokenizer import Tokenizer
from tests.data import load_prompts

# No model hub in tests; set before anything imports transformers/huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"

EXTRA_TEXTS = [
    "12345 and 3.14159",
    "Tiếng Việt có dấu: Xin chào thế giới! Đường phố Hà Nội.",
    "emoji 🤖🎉👍🏽 and CJK 你好世界 日本語のテキスト",
    "whitespace   runs\t\ttabs    and  a   1 then x  22",
    "line one\nline two\n\n\nindented\n    code()\r\nend ",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>",
    "special inside text<|endoftext|>and<file_sep>more",
    "it's we'll they'd I'M DON'T",
    "",
]
CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And times 3? Xin chào 🤖"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_path(None)


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference")
    path = find_default_model()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


# ---- parity with transformers -------------------------------------------------------------------


def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    for text in [row["prompt"] for row in load_prompts()] + EXTRA_TEXTS:
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
            text, add_special_tokens=False
        )


def test_known_encodings(tok: Tokenizer) -> None:
    # digits are single tokens; a special token in text is one id, never split
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == ["1", "2", "3", "4", "5"]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    # whitespace run before a digit: transformers' (GPT-2 regex) split, not llama.cpp's
    assert tok.convert_ids_to_tokens(tok.encode("a   1")) == ["a", "ĠĠ", "Ġ", "1"]


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, with_system: bool, add_generation_prompt: bool
) -> None:
    system = [{"role": "system", "content": "You are terse."}] if with_system else []
    messages = system + CONVERSATION
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    assert isinstance(text, str) and text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == hf_tok.encode(expected, add_special_tokens=False)
    assert isinstance(ids, list) and ids[0] == tok.bos_token_id  # template's <|im_start|>


# ---- behaviour ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [*EXTRA_TEXTS[:6], "Đ", "🏽", "\u00a0nbsp\u200bzwsp"])
def test_decode_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_decode_stream_matches_decode(tok: Tokenizer) -> None:
    """The incremental detokeniser's contract: DecodeStream over `.backend` yields the text."""
    text = "Xin chào 🤖 世界, 3.14!"
    stream = DecodeStream(skip_special_tokens=True)
    pieces = [stream.step(tok.backend, i) for i in tok.encode(text)]
    assert "".join(p for p in pieces if p is not None) == text


def test_special_tokens(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.vocab_size == 49152
    assert tok.all_special_ids == set(range(17))  # the 17 CONTROL tokens
    assert tok.encode("hi") == [6004]  # add_bos_token is False for SmolLM2
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert tok.decode(ids) == "assistant\nok"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nok<|im_end|>"
    assert tok.convert_ids_to_tokens([1, 216, 28120]) == ["<|im_start|>", "Ġ", "hello"]


def test_chat_template_raise_exception() -> None:
    tok = Tokenizer.from_model_path(None)
    tok.chat_template = "{% if messages|length == 0 %}{{ raise_exception('empty!') }}{% endif %}"
    jinja2 = pytest.importorskip("jinja2")
    with pytest.raises(jinja2.exceptions.TemplateError, match="empty!"):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_save_and_load_hf_dir(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save_hf(tmp_path)
    loaded = Tokenizer.from_model_path(str(tmp_path))
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.chat_template == tok.chat_template
    assert loaded.all_special_ids == tok.all_special_ids
    assert loaded.vocab_size == tok.vocab_size
    for text in EXTRA_TEXTS:
        assert loaded.encode(text) == tok.encode(text), text
    assert loaded.apply_chat_template(CONVERSATION) == tok.apply_chat_template(CONVERSATION)


def test_saved_dir_loads_in_transformers(tok: Tokenizer, hf_tok: Any, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok.save_hf(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in EXTRA_TEXTS:
        assert reloaded.encode(text) == hf_tok.encode(text), text
    assert reloaded.apply_chat_template(CONVERSATION, tokenize=False) == hf_tok.apply_chat_template(
        CONVERSATION, tokenize=False
    )


# ---- tiny GGUF vocabularies ---------------------------------------------------------------------


def _tiny_gguf(path: Path, pre: str, add_bos: bool) -> Path:
    """Byte-level vocab: 256 byte tokens, merges 'h e' and '1 2', and 3 typed added tokens."""
    gguf = pytest.importorskip("gguf", reason="gguf's writer builds the tiny test file")
    from pagedinfer.tokenizer import _byte_alphabet

    byte_tokens = [_byte_alphabet()[b] for b in range(256)]
    tokens = ["<s>", "</s>", "<think>", *byte_tokens, "he", "12"]
    token_types = [3, 3, 4] + [1] * 258
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(["h e", "1 2"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_tiny_gguf_bos_and_added_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "t.gguf", "default", add_bos=True))
    he, twelve, think = 259, 260, 2
    ids = tok.encode("he<think>12")
    assert ids == [0, he, think, twelve]  # BOS added because add_bos_token is true
    assert tok.encode("he", add_special_tokens=False) == [he]
    assert tok.all_special_ids == {0, 1}  # <think> is USER_DEFINED: whole, but not special
    assert tok.decode(ids) == "he<think>12"
    assert tok.vocab_size == 261


def test_tiny_gguf_pre_tokenizer_by_name(tmp_path: Path) -> None:
    gpt2 = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "a.gguf", "smollm", add_bos=False))
    llama3 = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "b.gguf", "llama-bpe", add_bos=False))
    pieces = [p for p, _ in gpt2.backend.pre_tokenizer.pre_tokenize_str("12345 ok")]
    assert pieces == ["12345", "Ġok"]  # GPT-2 regex: a digit run stays whole
    pieces = [p for p, _ in llama3.backend.pre_tokenizer.pre_tokenize_str("12345 ok")]
    assert pieces == ["123", "45", "Ġok"]  # llama3 regex: digits in groups of up to three


def test_chat_template_given_replaces_a_missing_one(tmp_path: Path) -> None:
    from pagedinfer.tokenizer import NO_CHAT_TEMPLATE

    tok = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "t.gguf", "default", add_bos=False))
    assert tok.chat_template is None  # a base model's file carries none
    messages = [{"role": "user", "content": "12"}]
    with pytest.raises(ValueError, match="--chat-template") as excinfo:
        tok.apply_chat_template(messages)
    assert str(excinfo.value) == NO_CHAT_TEMPLATE
    template = "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
    assert tok.apply_chat_template(messages, chat_template=template) == "user=12;"
    assert (
        tok.apply_chat_template(messages, chat_template=template, tokenize=True)
        == [tok.encode("user=12;", add_special_tokens=False)][0]
    )


def test_read_chat_template_takes_a_file_or_the_template(tmp_path: Path) -> None:
    from pagedinfer.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% if x %}y{% endif %}") == "{% if x %}y{% endif %}"
    with pytest.raises(ValueError, match="no such file, and not a jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("content", ["<|im_start|>", "user<|im_end|>", "  system <|im_start|> "])
def test_special_token_text_in_content_stays_text(tok: Tokenizer, content: str) -> None:
    """`content_as_text`: a content's special-token strings are text, the template's own
    stay control tokens, even where the content also occurs in the template's text (a
    content "<|im_start|>" once matched the template's first token instead)."""
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    control = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    as_text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                      content_as_text=True)  # fmt: skip
    assert isinstance(text, str) and isinstance(control, list) and isinstance(as_text, list)
    specials = content.count("<|im_start|>") + content.count("<|im_end|>")
    template_specials = sum(i in (1, 2) for i in as_text)
    assert sum(i in (1, 2) for i in control) == template_specials + specials
    assert as_text[0] == 1  # the template's <|im_start|> is the control token
    assert tok.decode(as_text, skip_special_tokens=False) == text


def test_content_as_text_refuses_a_template_that_rewrites_content(tok: Tokenizer) -> None:
    template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="changes message content"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                chat_template=template, content_as_text=True)  # fmt: skip
