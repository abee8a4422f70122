"""The internal message codec: every message survives a round trip on its channel, and the
decoder refuses anything else with a WireError that says what was wrong (never another
exception: a receiving process logs and drops the message, it must not crash on it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl_mp.message.codec import PROTOCOL_VERSION, Channel, WireError, pack_ids, unpack_ids
from minisgl_mp.message.messages import (
    DETOKENIZER_CHANNEL, INTERNAL_MAX_BYTES, SCHEDULER_CHANNEL, TOKENIZER_CHANNEL, AbortReq, AdminReply,
    AdminReq, CheckGrammarReq, BatchTextOut, BatchTokenOut, DetokParams, GenerateReq, LogprobEntry, ReqError, ShutdownReq,
    TextOut, TokenOut,
)

CHANNELS = [SCHEDULER_CHANNEL, DETOKENIZER_CHANNEL, TOKENIZER_CHANNEL]
LOGPROB = LogprobEntry(logprob=-0.25, top_ids=[7, 3, 9], top_logprobs=[-0.25, -1.5, -3.0])
TOKEN_OUT = TokenOut(
    rid="r-1", new_ids=[5, 0, 8191], finished=True, finish_reason="stop", matched_stop="\n\n",
    prompt_tokens=12, completion_tokens=3, cached_tokens=4, logprobs=[LOGPROB],
    detok=DetokParams(skip_special_tokens=False, stop=["###"], min_tokens=2, prompt_tail=[1, 2, 3]),
)
TEXT_OUT = TextOut(
    rid="r-2", text="héllo ✓", new_ids=[42], finished=False, finish_reason=None, matched_stop=None,
    prompt_tokens=1, completion_tokens=1, cached_tokens=0, logprobs=[],
)
# (channel, message): every message type on every channel that carries it.
CASES: list[tuple[Channel, Any]] = [
    (SCHEDULER_CHANNEL, GenerateReq("g-1", [1, 2, 2**31 - 1, 0], {"max_tokens": 8, "stop": ["x"], "seed": None})),
    (SCHEDULER_CHANNEL, GenerateReq("g-empty", [], {})),
    (SCHEDULER_CHANNEL, AbortReq("g-1")),
    (SCHEDULER_CHANNEL, AdminReq("admin-1", "stats")),
    (SCHEDULER_CHANNEL, CheckGrammarReq("admin-2", {"regex": "[0-9]+", "max_tokens": 4})),
    (SCHEDULER_CHANNEL, ShutdownReq("test")),
    (DETOKENIZER_CHANNEL, BatchTokenOut([TOKEN_OUT, dataclasses.replace(TOKEN_OUT, rid="r-3", detok=None,
                                                                      matched_stop=2, finish_reason=None)])),
    (DETOKENIZER_CHANNEL, BatchTokenOut([])),
    (DETOKENIZER_CHANNEL, ReqError("r-1", "token id 9 is outside the vocabulary", "invalid_request")),
    (DETOKENIZER_CHANNEL, AdminReply("admin-1", True, {"running": 0, "nested": {"a": [1, 2.5, None]}})),
    (DETOKENIZER_CHANNEL, ShutdownReq("bye")),
    (TOKENIZER_CHANNEL, BatchTextOut([TEXT_OUT, dataclasses.replace(TEXT_OUT, finished=True, logprobs=[LOGPROB])])),
    (TOKENIZER_CHANNEL, ReqError("r-2", "boom", "internal")),
    (TOKENIZER_CHANNEL, AdminReply("admin-2", False, {"error": "busy"})),
]


def wire(**fields: Any) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def generate_fields(**overrides: Any) -> dict[str, Any]:
    """A valid generate message as a map, with `overrides` applied (None: drop the field)."""
    d = {"t": "generate", "v": PROTOCOL_VERSION, "rid": "g-1", "input_ids": pack_ids([1, 2]), "sampling_params": {}}
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not None}


# ---- round trips -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("channel", "msg"), CASES,
                         ids=[f"{c.name}-{type(m).TAG}-{i}" for i, (c, m) in enumerate(CASES)])
def test_every_message_round_trips(channel: Channel, msg: Any) -> None:
    assert channel.decode(channel.encode(msg)) == msg


def test_every_message_type_is_covered() -> None:
    carried = {(c.name, type(m)) for c, m in CASES}
    for channel in CHANNELS:
        for cls in channel._by_tag.values():
            assert (channel.name, cls) in carried, f"{cls.__name__} on {channel.name} has no round-trip case"


def test_a_field_with_a_default_may_be_left_out() -> None:
    """Decoding builds messages without their __init__ (the fast path): what it builds must be
    the message the constructor would, defaults included, and as frozen."""
    raw = msgpack.unpackb(DETOKENIZER_CHANNEL.encode(BatchTokenOut([TOKEN_OUT])), raw=False)
    del raw["outputs"][0]["detok"], raw["outputs"][0]["prompt_logprobs"]
    (got,) = DETOKENIZER_CHANNEL.decode(msgpack.packb(raw, use_bin_type=True)).outputs
    want = dataclasses.replace(TOKEN_OUT, detok=None, prompt_logprobs=None)
    assert got == want and type(got) is TokenOut
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.rid = "changed"  # type: ignore[misc]
    del raw["outputs"][0]["rid"]
    with pytest.raises(WireError, match=r"batch_token_out\.outputs\[0\]: missing field 'rid'"):
        DETOKENIZER_CHANNEL.decode(msgpack.packb(raw, use_bin_type=True))


def test_token_ids_travel_packed_not_as_lists() -> None:
    data = SCHEDULER_CHANNEL.encode(GenerateReq("g", list(range(1000)), {}))
    raw = msgpack.unpackb(data, raw=False)
    assert raw["input_ids"] == pack_ids(list(range(1000)))
    assert len(data) < 4 * 1000 + 100  # 4 bytes per id, not a msgpack int each
    assert unpack_ids(pack_ids([0, -1, 2**31 - 1])) == [0, -1, 2**31 - 1]


def test_a_message_is_refused_by_a_channel_that_does_not_carry_it() -> None:
    with pytest.raises(TypeError, match="TextOut is not a message of channel scheduler"):
        SCHEDULER_CHANNEL.encode(TEXT_OUT)
    with pytest.raises(WireError, match="unknown message type 'batch_text_out' on channel scheduler"):
        SCHEDULER_CHANNEL.decode(TOKENIZER_CHANNEL.encode(BatchTextOut([TEXT_OUT])))


# ---- strict decoding ------------------------------------------------------------------------------------
BAD = [
    ("unknown type", wire(t="fly", v=PROTOCOL_VERSION), "unknown message type 'fly'"),
    ("no type", wire(v=PROTOCOL_VERSION, rid="x"), "unknown message type None"),
    ("wrong version", wire(**generate_fields(v=PROTOCOL_VERSION + 1)),
     f"protocol version {PROTOCOL_VERSION + 1} is not supported"),
    ("no version", wire(**generate_fields(v=None)), "protocol version None is not supported"),
    ("missing field", wire(**generate_fields(rid=None)), "generate: missing field 'rid'"),
    ("mistyped field", wire(**generate_fields(rid=5)), "generate.rid: expected str, got int"),
    ("unknown field", wire(**generate_fields(priority=3)), "generate: unknown field(s) priority"),
    ("packed ids of bad length", wire(**generate_fields(input_ids=b"\x01\x00\x00")),
     "packed token ids have 3 bytes, not a multiple of 4"),
    ("ids as a list", wire(**generate_fields(input_ids=[1, 2])),
     "generate.input_ids: expected packed int32 bytes, got list"),
    ("params not a map", wire(**generate_fields(sampling_params=[1])), "generate.sampling_params: expected a map"),
    ("extension type", wire(**generate_fields(rid=msgpack.ExtType(7, b"abc"))),
     "msgpack extension type 7 is not accepted"),
    ("not a map", msgpack.packb([1, 2, 3]), "expected a msgpack map, got list"),
    ("truncated", wire(**generate_fields())[:-3], "malformed msgpack"),
    ("trailing bytes", wire(**generate_fields()) + b"\x00", "malformed msgpack"),
    ("not msgpack", b"\xc1", "malformed msgpack"),
    ("empty", b"", "malformed msgpack"),
]


@pytest.mark.parametrize(("data", "problem"), [(d, p) for _, d, p in BAD], ids=[name for name, _, _ in BAD])
def test_strict_decoding_names_the_problem(data: bytes, problem: str) -> None:
    with pytest.raises(WireError) as info:
        SCHEDULER_CHANNEL.decode(data)
    assert problem in str(info.value)


def test_bools_and_ints_are_not_mixed_up() -> None:
    with pytest.raises(WireError, match="admin_reply.ok: expected a boolean, got int"):
        DETOKENIZER_CHANNEL.decode(wire(t="admin_reply", v=PROTOCOL_VERSION, rid="a", ok=1, result={}))
    batch = msgpack.unpackb(DETOKENIZER_CHANNEL.encode(BatchTokenOut([TOKEN_OUT])), raw=False)
    batch["outputs"][0]["prompt_tokens"] = True
    with pytest.raises(WireError, match=r"batch_token_out\.outputs\[0\]\.prompt_tokens: expected an integer, got bool"):
        DETOKENIZER_CHANNEL.decode(msgpack.packb(batch, use_bin_type=True))


def test_a_nested_error_names_its_path() -> None:
    good = msgpack.unpackb(DETOKENIZER_CHANNEL.encode(BatchTokenOut([TOKEN_OUT, TOKEN_OUT])), raw=False)
    good["outputs"][1]["logprobs"][0]["top_logprobs"] = ["high"]
    path = r"batch_token_out\.outputs\[1\]\.logprobs\[0\]\.top_logprobs\[0\]"
    with pytest.raises(WireError, match=path + ": expected a number"):
        DETOKENIZER_CHANNEL.decode(msgpack.packb(good, use_bin_type=True))


def test_an_oversized_message_is_refused_before_unpacking() -> None:
    with pytest.raises(WireError, match=f"exceeds the {INTERNAL_MAX_BYTES}-byte bound"):
        SCHEDULER_CHANNEL.decode(b"\x00" * (INTERNAL_MAX_BYTES + 1))
    small = Channel("small", GenerateReq, max_bytes=64)
    msg = GenerateReq("g", list(range(100)), {})
    with pytest.raises(WireError, match="message of 4.. bytes exceeds the 64-byte bound"):
        small.decode(SCHEDULER_CHANNEL.encode(msg))


def test_the_timestamp_extension_type_is_refused_too() -> None:
    with pytest.raises(WireError, match="extension type"):
        SCHEDULER_CHANNEL.decode(wire(**generate_fields(sampling_params={"seed": msgpack.Timestamp(1, 0)})))


# ---- fuzzing: nothing but WireError ---------------------------------------------------------------------
def _decode_or_wire_error(channel: Channel, data: bytes) -> None:
    try:
        channel.decode(data)
    except WireError:
        pass


scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(channel=st.sampled_from(CHANNELS), data=st.binary(max_size=200))
def test_random_bytes_only_raise_wire_error(channel: Channel, data: bytes) -> None:
    _decode_or_wire_error(channel, data)


@FUZZ
@given(channel=st.sampled_from(CHANNELS), value=values)
def test_random_msgpack_values_only_raise_wire_error(channel: Channel, value: Any) -> None:
    _decode_or_wire_error(channel, msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(case=st.sampled_from(CASES), data=st.data())
def test_mutated_real_messages_only_raise_wire_error(case: tuple[Channel, Any], data: st.DataObject) -> None:
    """Valid messages with one field replaced, dropped or added, at any depth: the decoder
    sees well-formed maps with the right tag, so every field check is exercised."""
    channel, msg = case
    tree = msgpack.unpackb(channel.encode(msg), raw=False)
    node = tree
    while True:  # walk down to a random map or list inside the message
        children = [v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list)) and v]
        if not children or not data.draw(st.booleans(), label="descend"):
            break
        node = data.draw(st.sampled_from(children), label="child")
    if isinstance(node, dict):
        key = data.draw(st.sampled_from(sorted(node)) | st.text(max_size=6), label="key")
        if data.draw(st.booleans(), label="drop") and key in node:
            del node[key]
        else:
            node[key] = data.draw(values, label="value")
    else:
        node[data.draw(st.integers(0, len(node) - 1), label="index")] = data.draw(values, label="value")
    _decode_or_wire_error(channel, msgpack.packb(tree, use_bin_type=True))
