"""Describe a `pagedinfer.tokenizer.Tokenizer` to the grammar libraries.

Role: both grammar backends need the vocabulary as byte strings (to know which tokens can extend
the text matched so far), the end-of-sequence token, and which tokens are special (never text).
This module builds, once per (tokenizer, model vocab size), xgrammar's `TokenizerInfo` and
llguidance's `LLTokenizer`, without going through transformers.

- xgrammar: `TokenizerInfo(encoded_vocab, vocab_type, vocab_size=..., stop_token_ids=[eos])`
  from the id-ordered vocabulary. Special tokens other than EOS are given an empty spelling,
  which is how xgrammar recognises special tokens (its Hugging Face path would spell
  `<|im_start|>` as text and let a JSON string contain it). The vocabulary type and
  `add_prefix_space` come from the serialised `tokenizers` pipeline.
- llguidance: `LLTokenizer(tokenizer_json, n_vocab=..., eos_token=eos)` on the `tokenizers` JSON,
  which is exactly what `llguidance.hf.from_tokenizer` does; llguidance marks the special added
  tokens itself.

`vocab_size` is the model's (LM head rows). Ids past the tokenizer's vocabulary exist only as
logits and are always disallowed by both libraries.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance
    import xgrammar

    from pagedinfer.tokenizer import Tokenizer

__all__ = ["encoded_vocab", "llguidance_tokenizer", "require_eos", "xgrammar_tokenizer_info"]

_lock = threading.Lock()
_xgr_cache: weakref.WeakKeyDictionary[Tokenizer, dict[int, xgrammar.TokenizerInfo]] = (
    weakref.WeakKeyDictionary()
)
_llg_cache: weakref.WeakKeyDictionary[Tokenizer, dict[int, llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)


def require_eos(tokenizer: Tokenizer) -> int:
    """The EOS id, which structured output needs to end a grammar."""
    if tokenizer.eos_token_id is None:
        raise ValueError("structured output needs a tokenizer with an EOS token")
    return int(tokenizer.eos_token_id)


def encoded_vocab(tokenizer: Tokenizer, *, blank_special: bool = True) -> list[str]:
    """Vocabulary spellings in id order ("Ġworld" for byte-level BPE); ids without a token are
    "". With `blank_special`, special tokens other than EOS are "" too (xgrammar's marker)."""
    vocab: dict[str, int] = tokenizer.backend.get_vocab(with_added_tokens=True)
    size = max(tokenizer.vocab_size, max(vocab.values(), default=-1) + 1)
    spelled = [""] * size
    for text, idx in vocab.items():
        spelled[idx] = text
    if blank_special:
        for idx in tokenizer.all_special_ids:
            if idx != tokenizer.eos_token_id and 0 <= idx < size:
                spelled[idx] = ""
    return spelled


def _backend_json(tokenizer: Tokenizer) -> str:
    """The `tokenizers` pipeline as JSON, without padding/truncation (as llguidance.hf does)."""
    backend = tokenizer.backend
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    return str(backend.to_str())


def _component_types(component: Any) -> list[dict[str, Any]]:
    """A pipeline component and, for a Sequence, its members."""
    if not isinstance(component, dict):
        return []
    members = component.get("decoders") or component.get("pretokenizers")
    members = members or component.get("normalizers") or []
    return [component, *(m for m in members if isinstance(m, dict))]


def _vocab_metadata(backend_json: str) -> tuple[xgrammar.VocabType, bool]:
    """(vocab type, add_prefix_space) of a `tokenizers` pipeline, for xgrammar."""
    import xgrammar as xgr

    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is not None:  # what TokenizerInfo.from_huggingface uses
        try:
            meta = detect(backend_json)
            return xgr.VocabType(meta["vocab_type"]), bool(meta["add_prefix_space"])
        except Exception:  # fall back to our own reading of the pipeline
            pass
    spec = json.loads(backend_json)
    decoders = {d.get("type") for d in _component_types(spec.get("decoder"))}
    if "ByteLevel" in decoders:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in decoders:
        pre = _component_types(spec.get("pre_tokenizer"))
        norm = _component_types(spec.get("normalizer"))
        prefix = any(
            p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
            for p in pre
        ) or any(n.get("type") == "Prepend" for n in norm)
        return xgr.VocabType.BYTE_FALLBACK, prefix
    return xgr.VocabType.RAW, False


def xgrammar_tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of `tokenizer` with a `vocab_size`-wide mask; cached per tokenizer."""
    with _lock:
        cached = _xgr_cache.get(tokenizer, {}).get(vocab_size)
    if cached is not None:
        return cached
    import xgrammar as xgr

    eos = require_eos(tokenizer)
    if eos >= vocab_size:
        raise ValueError(f"the EOS id {eos} is outside the model vocab ({vocab_size} tokens)")
    vocab_type, add_prefix_space = _vocab_metadata(_backend_json(tokenizer))
    info = xgr.TokenizerInfo(
        # Tokens past the model's vocabulary (added tokens it has no logits for) are dropped.
        encoded_vocab(tokenizer)[:vocab_size],
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=[eos],
        add_prefix_space=add_prefix_space,
    )
    with _lock:
        _xgr_cache.setdefault(tokenizer, {})[vocab_size] = info
    return info


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` with a `vocab_size`-wide mask; cached per tokenizer.

    llguidance cannot describe a model vocabulary smaller than the tokenizer's.
    """
    with _lock:
        cached = _llg_cache.get(tokenizer, {}).get(vocab_size)
    if cached is not None:
        return cached
    import llguidance

    eos = require_eos(tokenizer)
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"the guidance backend needs the model vocab size ({vocab_size}) to be at least "
            f"the tokenizer's ({tokenizer.vocab_size}); use the xgrammar backend"
        )
    try:
        ll_tokenizer = llguidance.LLTokenizer(
            _backend_json(tokenizer), n_vocab=vocab_size, eos_token=eos
        )
    except Exception as e:  # the Rust side raises ValueError/RuntimeError variously
        raise ValueError(f"llguidance cannot use this tokenizer: {e}") from e
    with _lock:
        _llg_cache.setdefault(tokenizer, {})[vocab_size] = ll_tokenizer
    return ll_tokenizer
