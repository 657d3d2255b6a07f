"""Text <-> token ids, and chat templates, on top of the Rust `tokenizers` library.

Role: one small `Tokenizer` that the engine's input processor (encode, chat template) and output
processor (incremental detokenisation through `tokenizers.decoders.DecodeStream` on `.backend`)
share. It is built either from a GGUF file's tokenizer metadata or from a Hugging Face
directory's `tokenizer.json` + `tokenizer_config.json`.

GGUF files describe their tokenizer as arrays (tokens, scores, token types, merges) plus a
model name. Two are rebuilt, each to encode and decode exactly as transformers' GGUF loader
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`) does; anything else is refused
with a ValueError naming the supported ones.

`tokenizer.ggml.model == "gpt2"` (byte-level BPE: SmolLM, Qwen, Llama 3):
- vocabulary and merges straight from the file; a token written outside the GPT-2 byte alphabet
  is re-spelled from its UTF-8 bytes;
- pre-tokenizer: a `Split` on the regex named by `tokenizer.ggml.pre` when we know it
  (llama3-style, qwen2), otherwise the GPT-2 regex built into `ByteLevel`. SmolLM's "smollm"
  falls in the second group, like in transformers. llama.cpp additionally isolates every digit
  for "smollm". The vocabulary has no multi-digit tokens, so the two agree except on whitespace
  runs directly before a digit ("a   1"), where we follow transformers;
- tokens typed CONTROL (3) whose spelling is in the byte alphabet become special added tokens;
  USER_DEFINED (4) become plain added tokens; BOS/EOS only as `add_{bos,eos}_token` say.

`tokenizer.ggml.model == "llama"` (SentencePiece written by llama.cpp: Llama 2, Mistral, Gemma):
- a BPE model with byte fallback (`<0x00>`..`<0xFF>` carry the bytes of characters outside the
  vocabulary) and `fuse_unk`. The merges come from `tokenizer.ggml.merges` when the file has
  them; otherwise they are rebuilt from the vocabulary: every split of a token into two tokens,
  best merged token first, which is SentencePiece's own "highest-scoring pair" rule. The rank is
  the token's score, except for Gemma, whose scores do not follow its merge order: there the
  file order is the rank;
- the text pipeline is picked by `general.architecture`, as in transformers:
  - gemma, gemma2, gemma3: spaces become "▁" in a normalizer and no prefix is added. The file
    spells its all-space tokens with real spaces ("  "); they are re-spelled "▁▁" first, or no
    text could reach them;
  - phi3: a normalizer prepends "▁" to the text and replaces spaces;
  - any other (llama, mistral, ...): a `Metaspace` pre-tokenizer that prepends "▁" to the
    text's first piece only (prepend_scheme "first": not after a special token, and not to text
    that starts with a space already), and a decoder that strips that one leading space.
  transformers ignores `tokenizer.ggml.add_space_prefix`, and so do we (llama.cpp honours it:
  it adds the space after every special token too, and even before a leading one, so
  llama.cpp and we disagree on such text);
- CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens. The named
  BOS/EOS/UNK/PAD tokens (and the names transformers' tokenizer class presets: `<s>`, `</s>`,
  `<unk>`; for Gemma `<bos>`, `<eos>`, `<unk>`, `<pad>`, `<mask>`) are special too when the
  vocabulary has them. transformers would also append such a name that the vocabulary lacks
  as a new id; we never grow the vocabulary past the model's;
- BOS is added unless `tokenizer.ggml.add_bos_token` says otherwise (llama.cpp's default for
  SentencePiece); EOS only when `add_eos_token` asks.

Invariants: `vocab_size` counts added tokens, and from a GGUF file it never exceeds the file's
token count. Byte-level BPE round-trips any text without special-token strings:
`decode(encode(s)) == s` (we never clean up spaces). SentencePiece round-trips too, except
that a "▁" in the text reads back as a space and, outside Gemma, a leading space is lost.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pagedinfer.gguf_metadata import read_gguf_metadata, resolve_model

if TYPE_CHECKING:
    from collections.abc import Callable

    import jinja2

    from pagedinfer.model.gguf import GGUFFile

__all__ = ["NO_CHAT_TEMPLATE", "Tokenizer", "read_chat_template"]

NO_CHAT_TEMPLATE = (
    "The model has no chat template (a base model serves completions): give one with "
    "--chat-template for `pagedinfer serve`, or chat_template= for LLM.chat"
)


def read_chat_template(value: str) -> str:
    """`--chat-template`'s value: a file's contents, or the template itself (as vLLM takes
    it). ValueError for a value that is neither an existing file nor a jinja template."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a jinja template")


_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.model` values we rebuild, for the refusal message.
_GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# SentencePiece's word-boundary marker: a space, in the vocabulary's spelling.
_SPACE_MARK = "\u2581"
# The text pipeline of a SentencePiece vocabulary by `general.architecture` (transformers'
# GGUF_SENTENCEPIECE_BUILDERS); every other architecture is "llama".
_SENTENCEPIECE_STYLES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
# Token names the tokenizer class transformers builds presets as special (LlamaTokenizer,
# GemmaTokenizer): they are special whenever the vocabulary has them, whatever their type.
_PRESET_SPECIAL = {
    "llama": ("<unk>", "<s>", "</s>"),
    "phi3": ("<unk>", "<s>", "</s>"),
    "gemma": ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
}

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`. Names not listed use ByteLevel's own
# GPT-2 regex, which is what transformers does for them (including "smollm").
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_REGEXES = {
    "llama3": _LLAMA3_REGEX,
    "llama-v3": _LLAMA3_REGEX,
    "llama-bpe": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
}


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes (controls, space, ...)
    are shifted to code points 256, 257, ... in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return mapping


def _token_text(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, an AddedToken dict, or None."""
    if isinstance(token, dict):
        return str(token.get("content"))
    return None if token is None else str(token)


class Tokenizer:
    """Encode/decode text and render chat templates for one model.

    Build with `from_gguf`, `from_hf_dir` or `from_model_path`; the constructor takes an already
    configured `tokenizers.Tokenizer` (whose post-processor decides what `add_special_tokens`
    adds) plus the special-token ids and chat template.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        ids = (bos_token_id, eos_token_id, pad_token_id, unk_token_id)
        self.all_special_ids: set[int] = special | {i for i in ids if i is not None}

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: str | os.PathLike[str] | GGUFFile) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (a path, or a `GGUFFile` the caller has
        open already): byte-level BPE ("gpt2") or SentencePiece ("llama")."""
        meta = read_gguf_metadata(gguf) if isinstance(gguf, (str, os.PathLike)) else gguf.metadata
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _byte_level_backend(meta)
        elif kind == "llama":
            backend = _sentencepiece_backend(meta)
        else:
            known = ", ".join(f"{name!r} {what}" for name, what in _GGUF_TOKENIZER_MODELS.items())
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: {known})")

        def token_id(name: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{name}")
            return None if value is None else int(value)

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        # (older files have no flag); transformers follows it.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _post_processor(backend, bos, eos, add_bos, add_eos)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=token_id("padding_token_id"),
            unk_token_id=token_id("unknown_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` as is; special tokens and template from tokenizer_config.json."""
        model_dir = os.fspath(model_dir)
        backend = BackendTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()

        def token_id(name: str) -> int | None:
            text = _token_text(config.get(name))
            return None if text is None else backend.token_to_id(text)

        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            chat_template=template,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
        )

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str] | None = None) -> Tokenizer:
        """Tokenizer for a `.gguf` file, an HF directory, a name in
        `gguf_metadata.KNOWN_MODELS`, or (None) the default model."""
        path = resolve_model(path)
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if path.endswith(".gguf"):
            return cls.from_gguf(path)
        raise ValueError(f"{path!r} is neither a .gguf file nor a model directory")

    # ---- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings of `ids`, as the vocabulary spells them: "Ġworld" (byte-level
        BPE), "▁world" or a byte "<0xE4>" (SentencePiece)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in characters of its vocabulary entry. No token stands
        for more characters of text than that (a byte-level entry has one character per
        byte; a SentencePiece entry one per character, or more for a byte token), which
        bounds from below how many tokens a text needs (`serving_engine.check_text_fits`)."""
        return max((len(piece) for piece in self.backend.get_vocab()), default=1)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # ---- chat templates ----------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        content_as_text: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with `chat_template` (a jinja template), else the model's own.

        The prompt already carries every special token the template writes, so `tokenize=True`
        encodes it without adding BOS/EOS again. Extra keyword arguments reach the template.
        ValueError, naming the options that give one, when there is no template (a base
        model: it serves completions).

        `content_as_text` (with `tokenize=True`): special-token strings inside the messages'
        string contents (a user writing "<|im_start|>") are encoded as the plain text they
        are, not as the control tokens; only the template's own text yields those
        (`_encode_contents_as_text`). Off by default, as in vLLM.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(NO_CHAT_TEMPLATE)

        def render(messages: list[dict[str, Any]]) -> str:
            return _compile_template(template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_token_id) or "",
                eos_token=self.token_text(self.eos_token_id) or "",
                **template_kwargs,
            )

        text = render(messages)
        if not tokenize:
            return text
        if content_as_text:
            return self._encode_contents_as_text(text, messages, render)
        return self.encode(text, add_special_tokens=False)

    def _encode_contents_as_text(
        self,
        text: str,
        messages: list[dict[str, Any]],
        render: Callable[[list[dict[str, Any]]], str],
    ) -> list[int]:
        """The rendered `text`, encoded with each message's string content encoded with
        special-token strings split as ordinary text, the template's own text as usual.

        Where the contents lie is learnt by rendering the messages again with each content
        replaced by a marker no client can send (a fresh nonce): the text between markers
        is the template's, and must appear in `text` as it is, each content (as written or
        stripped, as templates write it) between. Searching `text` for a content instead
        would find it inside the template's own text ("<|im_start|>" sent as a content
        matches the template's first token, which then became text while the client's
        became a control token). ValueError when the template changes a content past
        recognizing (it cannot then be told from the template's text)."""
        nonce = secrets.token_hex(8)
        marked = [
            {**m, "content": f"\ue000{nonce}:{i}\ue001"}
            if isinstance(m.get("content"), str) and m["content"].strip()
            else m
            for i, m in enumerate(messages)
        ]
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(marked))
        changed = ValueError(
            "the chat template changes message content, so its special-token text "
            "cannot be kept as plain text (content_as_text)"
        )
        ids: list[int] = []
        pos = 0
        for k in range(0, len(parts), 2):
            own = parts[k]
            if not text.startswith(own, pos):
                raise changed
            ids += self.encode(own, add_special_tokens=False)
            pos += len(own)
            if k + 1 == len(parts):
                break
            content = messages[int(parts[k + 1])]["content"]
            after = parts[k + 2]
            for piece in (content, content.strip()):
                end = pos + len(piece)
                if text.startswith(piece, pos) and text.startswith(after, end):
                    break
            else:
                raise changed
            ids += self._plain_text_backend.encode(piece, add_special_tokens=False).ids
            pos = end
        if pos != len(text):
            raise changed
        return ids

    @functools.cached_property
    def _plain_text_backend(self) -> BackendTokenizer:
        """A copy of the backend that splits special-token strings as ordinary text (its
        own object: the flag is not toggled on the shared one, which threads encode with)."""
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    # ---- saving ------------------------------------------------------------------------------

    def save_hf(self, out_dir: str | os.PathLike[str]) -> None:
        """Write tokenizer.json and tokenizer_config.json that transformers' AutoTokenizer and
        `from_hf_dir` load back to the same encodings."""
        out_dir = os.fspath(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        self.backend.save(os.path.join(out_dir, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "bos_token": self.token_text(self.bos_token_id),
            "eos_token": self.token_text(self.eos_token_id),
            "pad_token": self.token_text(self.pad_token_id),
            "unk_token": self.token_text(self.unk_token_id),
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)


def _byte_level_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """The `tokenizers` pipeline of a "gpt2" (byte-level BPE) GGUF vocabulary."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    allowed = set(alphabet.values())
    spelled = [
        tok if set(tok) <= allowed else "".join(alphabet[b] for b in tok.encode("utf-8"))
        for tok in tokens
    ]
    vocab = {tok: i for i, tok in enumerate(spelled)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    regex = _PRE_TOKENIZER_REGEXES.get(meta.get("tokenizer.ggml.pre", ""))
    if regex is not None:
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, no_regex])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()

    # An added token spelled outside the byte alphabet is not matchable text of this
    # vocabulary (for CONTROL, a converter mislabel), so it is left alone, as in transformers.
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_id in zip(tokens, token_types, strict=True)
        if kind_id == _TOKEN_TYPE_CONTROL and set(tok) <= allowed
    ]
    backend.add_special_tokens(control)
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind_id in zip(tokens, token_types, strict=True)
        if kind_id == _TOKEN_TYPE_USER_DEFINED and set(tok) <= allowed
    ]
    backend.add_tokens(user)
    return backend


def _sentencepiece_backend(meta: dict[str, Any]) -> BackendTokenizer:
    """The `tokenizers` pipeline of a "llama" (SentencePiece) GGUF vocabulary; the text
    pipeline follows `general.architecture` (see the module docstring)."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    style = _SENTENCEPIECE_STYLES.get(meta.get("general.architecture", ""), "llama")
    ranks: list[float]
    if style == "gemma":
        # Same test as transformers: all whitespace, with at least one space (" \t" too).
        spelled = [_SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = [float(-i) for i in range(len(tokens))]  # file order is Gemma's merge order
    else:
        spelled = list(tokens)
        ranks = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    # A spelling listed twice keeps its last id, as a dict built in file order does.
    vocab = {tok: i for i, tok in enumerate(spelled)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _merges_by_rank(spelled, ranks, vocab)
    # Gemma's tokenizer class names "<unk>" as the model's unknown token; byte fallback makes it
    # unreachable whenever the 256 byte tokens are there.
    unk = "<unk>" if style == "gemma" and "<unk>" in vocab else None
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    to_text = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if style == "gemma":
        backend.normalizer = normalizers.Replace(" ", _SPACE_MARK)
        # A no-op after the normalizer (no spaces are left); kept so the pipeline, which the
        # grammar backends inspect, is transformers' own.
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(to_text)
    else:
        if style == "phi3":
            backend.normalizer = normalizers.Sequence(
                [normalizers.Prepend(_SPACE_MARK), normalizers.Replace(" ", _SPACE_MARK)]
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=_SPACE_MARK, prepend_scheme="first", split=False
            )
        # The prefix "▁" is no text of the user's: drop it (one leading space) again.
        backend.decoder = decoders.Sequence([*to_text, decoders.Strip(" ", 1, 0)])

    backend.add_special_tokens(
        [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind_id in zip(tokens, token_types, strict=True)
            if kind_id == _TOKEN_TYPE_CONTROL
        ]
    )
    # A USER_DEFINED token that was re-spelled (Gemma's "  ") is left out, as in transformers:
    # text reaches its "▁▁" spelling through the merges instead.
    backend.add_tokens(
        [
            AddedToken(tok, special=False, normalized=False)
            for tok, kind_id in zip(tokens, token_types, strict=True)
            if kind_id == _TOKEN_TYPE_USER_DEFINED and tok in vocab
        ]
    )
    named_ids = [
        meta.get(f"tokenizer.ggml.{key}")
        for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    ]
    named = [tokens[int(i)] for i in named_ids if i is not None and 0 <= int(i) < len(tokens)]
    added = {tok.content for tok in backend.get_added_tokens_decoder().values()}
    extra = dict.fromkeys(t for t in [*_PRESET_SPECIAL[style], *named] if t in vocab)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in extra if t not in added]
    )
    return backend


def _merges_by_rank(
    tokens: list[str], ranks: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a ranked vocabulary: every split of a token into two vocabulary
    tokens, ordered by the merged token's rank (highest first), then longer left part, then
    longer right part; ties keep the vocabulary's order (transformers' `generate_merges`, which
    the merges must equal for BPE to pick the same pairs)."""
    best = dict(zip(tokens, ranks))  # a repeated spelling: first position, last rank
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, rank in best.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-rank, -cut, cut - len(token), left, right))
    # Sort on the three keys only: a stable sort keeps ties in vocabulary order.
    candidates.sort(key=lambda c: (c[0], c[1], c[2]))
    return [(left, right) for _, _, _, left, right in candidates]


def _post_processor(
    backend: BackendTokenizer, bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor | None:
    """BOS/EOS around a single sequence (and each of a pair), only as the model asks."""
    pieces: list[tuple[str, int]] = []
    if add_bos and bos is not None:
        pieces.append((backend.id_to_token(bos) or "", bos))
    if add_eos and eos is not None:
        pieces.append((backend.id_to_token(eos) or "", eos))
    if not pieces:
        return None
    prefix = f"{pieces[0][0]} " if add_bos and bos is not None else ""
    suffix = f" {pieces[-1][0]}" if add_eos and eos is not None else ""
    return processors.TemplateProcessing(
        single=f"{prefix}$A{suffix}",
        pair=f"{prefix}$A{suffix} {prefix}$B:1{suffix}",
        special_tokens=pieces,
    )


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox, with the environment transformers templates expect
    (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
