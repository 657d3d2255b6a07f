"""The typed codec: tensors and arrays of every supported dtype round-trip bit-exactly, inline
or out of band (zero-copy both ways), inside dataclasses decoded into their declared types,
including the real executor messages; unsupported objects fail instead of being pickled."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch

from pagedinfer.core.kv_transfer_metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferSpec,
)
from pagedinfer.core.messages import KVTransferStats, LogprobsLists
from pagedinfer.core.sched_output import (
    CachedRequestData,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedinfer.distributed.serial import MsgpackDecoder, MsgpackEncoder
from pagedinfer.distributed.shm_mq import MessageQueue
from pagedinfer.sampling_params import SamplingParams, StructuredOutputsParams

TORCH_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                torch.int8, torch.uint8, torch.bool, torch.float64, torch.int16]  # fmt: skip
NUMPY_DTYPES = [np.float32, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_,
                np.float64, np.int16]  # fmt: skip
SHAPES = [(), (0,), (3,), (2, 0, 5), (64, 33)]  # (64, 33): past the inline threshold


@dataclass
class StepPayload:
    tensors: dict[str, torch.Tensor]
    mask: np.ndarray
    req_ids: list[str] = field(default_factory=list)
    extra: object = None


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)


def _round_trip(obj, type_=object):
    return MsgpackDecoder(type_).decode(MsgpackEncoder().encode(obj))


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _random_tensor(shape, dtype)
    out = _round_trip(tensor, torch.Tensor)
    assert isinstance(out, torch.Tensor) and _same_tensor(out, tensor)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_ndarray_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    array = _random_tensor(shape, torch.float64).numpy().astype(dtype)
    out = _round_trip(array, np.ndarray)
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out, array)
    assert out.flags.writeable


def test_small_arrays_inline_large_ones_out_of_band_without_copies() -> None:
    big = torch.arange(1000, dtype=torch.int32)  # [1000], 4000 bytes
    small = torch.arange(10, dtype=torch.int32)  # [10], 40 bytes: inline
    buffers = MsgpackEncoder().encode({"big": big, "small": small, "arr": big.numpy()})
    assert len(buffers) == 3  # msgpack + one buffer per large array
    # The encoder's buffers alias the tensor's memory.
    assert np.frombuffer(buffers[1], np.uint8).ctypes.data == big.data_ptr()
    # The decoder's tensors alias writable received buffers (MessageQueue.dequeue's kind)...
    received = [bytearray(b) for b in buffers]
    out = MsgpackDecoder(dict[str, object]).decode(received)
    assert out["big"].data_ptr() == np.frombuffer(received[1], np.uint8).ctypes.data
    assert torch.equal(out["big"], big) and torch.equal(out["small"], small)
    # ...and copy read-only ones (torch warns about, and must not write to, read-only memory).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = MsgpackDecoder(dict[str, object]).decode([bytes(b) for b in buffers])
    out["big"] += 1
    assert out["arr"].flags.writeable


def test_non_contiguous_inputs_arrive_contiguous() -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # [6, 4], strided
    array = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]  # [4, 3], strided
    out_tensor, out_array = _round_trip([tensor, array], tuple[torch.Tensor, np.ndarray])
    assert torch.equal(out_tensor, tensor) and out_tensor.is_contiguous()
    np.testing.assert_array_equal(out_array, array)


def test_dataclass_with_dict_of_tensors_and_ndarray_decodes_typed() -> None:
    payload = StepPayload(
        tensors={"hidden": torch.randn(8, 16).bfloat16(), "ids": torch.tensor([1, 2, 3])},
        mask=np.arange(12, dtype=np.int32).reshape(3, 4),
        req_ids=["a", "b"],
        extra={"nested": [torch.ones(2, dtype=torch.bool)]},
    )
    out = _round_trip(payload, StepPayload)
    assert isinstance(out, StepPayload) and out.req_ids == ["a", "b"]
    assert out.tensors.keys() == payload.tensors.keys()
    assert all(_same_tensor(out.tensors[k], v) for k, v in payload.tensors.items())
    np.testing.assert_array_equal(out.mask, payload.mask)
    assert _same_tensor(out.extra["nested"][0], payload.extra["nested"][0])
    # Typed decoding rejects an array where a tensor is declared (and vice versa).
    wrong = {"tensors": {"x": np.zeros(3)}, "mask": np.zeros(3)}
    with pytest.raises(msgspec.ValidationError, match="expected Tensor, got ndarray"):
        _round_trip(wrong, StepPayload)


def test_grammar_output_round_trip() -> None:
    grammar = GrammarOutput(
        req_ids=["r0", "r1"],
        bitmask=np.random.default_rng(0).integers(-(2**31), 2**31, (3, 1568), dtype=np.int32),
        num_rows=[1, 2],
        stats={"fill_s": 0.25},
    )
    out = _round_trip(grammar, GrammarOutput)
    assert out.req_ids == grammar.req_ids and out.num_rows == [1, 2] and out.stats == grammar.stats
    assert out.bitmask.dtype == np.int32
    np.testing.assert_array_equal(out.bitmask, grammar.bitmask)


def test_scheduler_and_model_runner_outputs_round_trip_typed() -> None:
    params = SamplingParams(
        temperature=0.7, top_k=20, seed=3, stop=["\n\n"], stop_token_ids=[2], max_tokens=64,
        logit_bias={5: -1.5}, structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
    )  # fmt: skip
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], [], params, [0, 1], 0)],
        scheduled_cached_reqs=CachedRequestData(["b"], [[7]], [130]),
        num_scheduled_tokens={"a": 3, "b": 1},
        total_num_scheduled_tokens=4,
        scheduled_spec_decode_tokens={"b": [9, 9]},
        finished_req_ids={"c"},
        preempted_req_ids={"d"},
        kv_connector_metadata=KVConnectorMetadata(
            loads=[KVTransferSpec("a", [0, 1], 16, 8, "key", {"remote_port": 5, "x": [1]})]
        ),
    )
    out = _round_trip(sched, SchedulerOutput)
    assert out == sched
    assert isinstance(out.kv_connector_metadata.loads[0], KVTransferSpec)
    assert isinstance(out.scheduled_new_reqs[0].sampling_params, SamplingParams)
    assert out.scheduled_new_reqs[0].sampling_params.all_stop_token_ids == {2}

    runner = ModelRunnerOutput(
        req_ids=["a", "b"],
        req_id_to_index={"a": 0, "b": 1},
        sampled_token_ids=[[5], [6, 7]],
        logprobs=LogprobsLists([[5, 1], [6, 1], [7, 2]], [[-0.1, -2.0]] * 3, [0, 0, 1]),
        draft_token_ids={"a": [1, 2]},
        kv_connector_output=KVConnectorOutput(
            finished_recving=["a"], invalid_block_ids=[3], stats=KVTransferStats(load_time_s=0.5)
        ),
    )
    out = _round_trip(runner, ModelRunnerOutput)
    assert out == runner and isinstance(out.logprobs, LogprobsLists)
    assert isinstance(out.kv_connector_output.stats, KVTransferStats)
    assert out.logprobs_row_of(1) == 1


def test_unsupported_objects_fail_instead_of_pickling() -> None:
    with pytest.raises(TypeError, match="never pickles"):
        MsgpackEncoder().encode({"f": lambda: None})
    with pytest.raises(TypeError, match="dtype"):
        MsgpackEncoder().encode(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096])  # inline, then the overflow path
def test_through_message_queue(chunk_bytes: int) -> None:
    writer = MessageQueue(1, max_chunk_bytes=chunk_bytes, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    reader.wait_until_ready(timeout=10)
    try:
        payload = StepPayload({"x": torch.randn(32, 64)}, np.arange(3, dtype=np.int32), ["a"])
        writer.enqueue(MsgpackEncoder().encode(payload))
        out = MsgpackDecoder(StepPayload).decode(reader.dequeue(timeout=10))
        assert torch.equal(out.tensors["x"], payload.tensors["x"]) and out.req_ids == ["a"]
        np.testing.assert_array_equal(out.mask, payload.mask)
    finally:
        reader.close()
        writer.close()
