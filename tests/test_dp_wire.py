"""What crosses between the API server and a data-parallel replica (``mechserve.dp.wire``): every message
round-trips through msgpack with its schema, errors come back as the same classes, and bytes that do
not follow the schema are refused (nothing is unpickled)."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from mechserve.api.config import EngineConfig
from mechserve.api.errors import (
    EngineDeadError,
    EngineStepError,
    EngineStoppedError,
    ParamError,
    RequestFailed,
    RequestRejected,
)
from mechserve.api.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SampleDelta
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.dp.wire import (
    ENCODER,
    FROM_REPLICA,
    TO_REPLICA,
    Add,
    Events,
    Failed,
    Load,
    ReplicaSpec,
    Shutdown,
    error_of,
    wire_error,
)
from mechserve.entrypoints.events import StreamEvent
from mechserve.spec.m16_request_draft_lengths import RejectReason


def test_an_add_carries_every_sampling_field_through_the_socket() -> None:
    params = SamplingParams(
        n=3,
        temperature=0.7,
        top_k=5,
        seed=11,
        max_tokens=9,
        stop=("\n\n", "END"),
        stop_token_ids=(2,),
        logprobs=2,
        prompt_logprobs=1,
        logit_bias={5: -1.5},
        bad_words=("bad",),
        structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    )
    add = Add("r1", "some text", [1, 2, 3], params, True, 123.5)
    back = TO_REPLICA.decode(ENCODER.encode(add))
    assert back == add and back.params == params and isinstance(back.params, SamplingParams)
    assert TO_REPLICA.decode(ENCODER.encode(Shutdown())) == Shutdown()


def test_a_steps_events_round_trip_with_logprobs_and_the_final_output() -> None:
    lp = [{7: Logprob(-0.1, 1, "a"), 9: Logprob(-2.0, 2, "b")}]
    delta = SampleDelta("r1", 0, [7], "a", True, "length", None, lp, [None, {3: Logprob(-1.0, 1, "x")}])
    output = RequestOutput(
        "r1",
        "p",
        [3, 4],
        [CompletionOutput(0, "a", [7], "length", None, lp, -0.1)],
        True,
        RequestMetrics(1.0, 2.0, 3.0, ((2.0,),), 1.5),
        num_cached_tokens=4,
    )
    message = Events([StreamEvent("r1", (delta,), output)])
    back = FROM_REPLICA.decode(ENCODER.encode(message))
    assert back == message
    assert FROM_REPLICA.decode(ENCODER.encode(Load(1, 2, 0.5, b"\x01"))) == Load(1, 2, 0.5, b"\x01")


@pytest.mark.parametrize(
    "error",
    [
        RequestRejected("r", RejectReason.TOO_LONG, "prompt of 9 > 8"),
        RequestFailed("r", "structured_outputs", "the matcher failed"),
        ParamError("logit_bias", "logit_bias: 999 is not a token id"),
        EngineStoppedError("the engine shut down"),
        EngineDeadError("the engine is dead"),
        ValueError("plain"),
    ],
)
def test_errors_come_back_as_the_same_class_with_the_fields_the_server_reads(error: Exception) -> None:
    wire = FROM_REPLICA.decode(ENCODER.encode(Failed("r", wire_error(error))))
    back = error_of(wire.error, "r")
    assert type(back) is type(error) and str(back) == str(error)
    for name in ("param", "reason", "detail"):
        assert getattr(back, name, None) == getattr(error, name, None)


def test_a_failed_step_names_its_causes_kind_not_its_message() -> None:
    error = EngineStepError("engine step 4 failed: boom")
    error.__cause__ = KeyError("secret")
    back = error_of(wire_error(error), "r")
    assert isinstance(back, EngineStepError) and type(back.__cause__).__name__ == "KeyError"
    assert "secret" not in repr(back.__cause__)


def test_bytes_that_do_not_follow_the_schema_are_refused_and_never_unpickled() -> None:
    with pytest.raises(msgspec.DecodeError):
        TO_REPLICA.decode(pickle.dumps(Shutdown))
    with pytest.raises(msgspec.ValidationError):
        TO_REPLICA.decode(msgspec.msgpack.encode({"type": "Add", "request_id": 5}))
    with pytest.raises(msgspec.ValidationError):  # SamplingParams' own checks run on the way in
        TO_REPLICA.decode(
            msgspec.msgpack.encode(
                {"type": "Add", "request_id": "r", "prompt": None, "prompt_token_ids": [1],
                 "params": {"temperature": -1.0}, "fit_max_tokens": False, "arrival": 0.0}
            )
        )  # fmt: skip


def test_a_replica_spec_carries_the_engine_config() -> None:
    config = EngineConfig(page_size=4, num_pages=64, max_waiting=8, seed=None)
    spec = ReplicaSpec("smollm2", config, 1, 2, 3, "m", "ipc:///tmp/a", "ipc:///tmp/b")
    back = msgspec.json.decode(msgspec.json.encode(spec), type=ReplicaSpec)
    assert back == spec and back.config == config
