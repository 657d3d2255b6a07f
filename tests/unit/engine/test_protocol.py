"""The engine-core wire protocol: typed msgspec messages, never pickle, malformed input
rejected with a clear error."""

from __future__ import annotations

import msgspec
import pytest

from pagedinfer.config import build_engine_config, config_from_json, config_to_json
from pagedinfer.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedinfer.engine.protocol import (
    EngineCoreReady,
    InputKind,
    UtilityCall,
    UtilityResult,
    decode_input,
    reject_malformed_add,
)
from pagedinfer.sampling_params import SamplingParams


def test_add_abort_utility_round_trip() -> None:
    request = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.5, top_k=4, max_tokens=7, stop=["\n"]),
        eos_token_id=2,
        arrival_time=12.5,
        priority=3,
        cache_salt="tenant",
    )
    kind, decoded = decode_input([InputKind.ADD.value, msgspec.msgpack.encode(request)])
    assert kind is InputKind.ADD and decoded == request
    kind, decoded = decode_input([InputKind.ABORT.value, msgspec.msgpack.encode(["a", "b"])])
    assert kind is InputKind.ABORT and decoded == ["a", "b"]
    call = UtilityCall(7, "reset_prefix_cache", [])
    kind, decoded = decode_input([InputKind.UTILITY.value, msgspec.msgpack.encode(call)])
    assert kind is InputKind.UTILITY and decoded == call
    assert decode_input([InputKind.SHUTDOWN.value, b""]) == (InputKind.SHUTDOWN, None)


def test_outputs_and_ready_round_trip() -> None:
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [5, 6], num_cached_tokens=16)], timestamp=3.0
    )
    data = msgspec.msgpack.encode(outputs)
    assert msgspec.msgpack.decode(data, type=EngineCoreOutputs) == outputs
    ready = EngineCoreReady(512, 49152, 91, 16, "float32", 1.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=EngineCoreReady) == ready
    result = UtilityResult(1, result=True)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=UtilityResult) == result


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"A"], "expected 2 frames"),
        ([b"Z", b""], "is not a valid InputKind"),
        ([b"A", b"\x93\x01\x02"], "bad ADD payload"),
        ([b"B", msgspec.msgpack.encode({"x": 1})], "bad ABORT payload"),
        # A pickle is just bytes here: it does not decode, it is never unpickled.
        ([b"A", b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00N."], "bad ADD payload"),
    ],
)
def test_malformed_messages_are_rejected(frames, message) -> None:
    with pytest.raises(ValueError, match=message):
        decode_input(frames)


def test_an_add_the_engine_cannot_decode_is_answered_not_dropped() -> None:
    """Settings valid in the front end but not once decoded (here min_tokens > max_tokens,
    written past the constructor's checks) must finish the request with "error" rather
    than leave its caller waiting forever."""
    request = EngineCoreRequest(
        request_id="r9",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=8, min_tokens=4),
        eos_token_id=2,
        arrival_time=1.0,
    )
    request.sampling_params.min_tokens = 50
    frames = [InputKind.ADD.value, msgspec.msgpack.encode(request)]
    with pytest.raises(ValueError, match="min_tokens"):
        decode_input(frames)
    answer = reject_malformed_add(frames, ValueError("bad"))
    assert answer is not None and len(answer.outputs) == 1
    (out,) = answer.outputs
    assert out.request_id == "r9" and str(out.finish_reason) == "error" and out.finished
    # Nothing to answer when even the id is unreadable, or for other kinds of message.
    assert reject_malformed_add([InputKind.ADD.value, b"\xc1"], ValueError()) is None
    assert reject_malformed_add([InputKind.ABORT.value, frames[1]], ValueError()) is None


def test_config_crosses_as_json() -> None:
    config = build_engine_config(dtype="float32", max_model_len=512, enable_prefix_caching=False)
    text = config_to_json(config)
    assert '"max_model_len":512' in text.replace(" ", "")
    assert config_from_json(text) == config
