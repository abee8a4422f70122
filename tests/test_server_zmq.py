"""The real server (launcher + tokenizer, scheduler and detokenizer processes) through its ZMQ
client endpoint: greedy outputs equal the offline engine's, 64 concurrent streams come out
whole and right, aborts and vanished clients free their KV pages, and every kind of bad
request gets an error reply naming what was wrong while the server keeps serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from minisgl_mp.client import AsyncClient, Client
from server_utils import ServerProcess, launch_server

pytestmark = pytest.mark.timeout(300)

KV_PAGES = 16384  # the default pool (GiBs) is more than these tests need
MAX_TOKENS = 16
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # runs until aborted
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Ünïcödé and emoji 🙂 are handled",
    "a",
]
SHARED_PREFIX = "You are a careful assistant. Answer the question below in one short sentence.\n"
# 64 prompts: half share a long prefix (cache hits, or one prefill batch, as timing has it).
CONCURRENT_PROMPTS = ([f"{SHARED_PREFIX}Question {i}: what is {i} plus {i}?" for i in range(32)]
                      + [f"Story number {i} begins with the words" + " and" * (i % 5) for i in range(32)])
CACHE_PREFIX = "Zebras quietly juggle seventeen violet umbrellas above the harbour, " * 3
CACHE_PROMPTS = [CACHE_PREFIX + "and then", CACHE_PREFIX + "until suddenly"]
CONTEXT_LEN = 4096  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, Any]:
    """The offline engine's greedy outputs (same prompts, same model), and its tokenizer."""
    from minisgl_mp import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), num_pages=KV_PAGES)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    chat = [{"role": "user", "content": "Say hello."}]
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                                    add_special_tokens=False)
    prompts = PROMPTS + CONCURRENT_PROMPTS + CACHE_PROMPTS
    outs = llm.generate(prompts + [chat_ids], params)
    return {"prompts": dict(zip(prompts, outs)), "chat": (chat, outs[-1]),
            "tokenizer": llm.tokenizer}


@pytest.fixture(scope="module")
def server(reference: dict[str, Any], tiny_model_dir: Path) -> Iterator[ServerProcess]:
    # One torch thread: beside the other processes on a small machine, a second one mostly
    # spin-waits (ten times slower per step on 2 busy cores).
    srv = launch_server(tiny_model_dir, "--num-pages", str(KV_PAGES), "--num-threads", "1", http=False)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.zmq, timeout=60) as c:
        yield c


def assert_pages_free(stats: dict[str, Any]) -> None:
    """Nothing runs, nothing is locked, and every page is free or held only by the cache."""
    assert (stats["running"], stats["waiting"], stats["protected_tokens"]) == (0, 0, 0), stats
    assert stats["free_tokens"] + stats["evictable_tokens"] == stats["total_tokens"], stats
    assert stats["health_error"] is None, stats


def recv(c: Client, timeout: float = 60.0) -> dict[str, Any]:
    if not c.sock.poll(int(timeout * 1000)):
        raise AssertionError(f"no reply within {timeout} s")
    return c.recv_raw()


# ---- correctness -----------------------------------------------------------------------------------
def test_greedy_outputs_equal_the_offline_engine(client: Client, reference: dict[str, Any]) -> None:
    for prompt in PROMPTS:
        want = reference["prompts"][prompt]
        got = client.generate(prompt, sampling_params=GREEDY)
        assert got["token_ids"] == want["token_ids"], prompt
        assert got["text"] == want["text"], prompt
        assert (got["finished"], got["finish_reason"]) == (True, want["finish_reason"])
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert got["usage"]["completion_tokens"] == len(want["token_ids"])


def test_token_ids_and_chat_messages_are_prompts_too(client: Client, reference: dict[str, Any]) -> None:
    want = reference["prompts"][PROMPTS[0]]
    ids = reference["tokenizer"].encode(PROMPTS[0])
    assert client.generate(input_ids=ids, sampling_params=GREEDY)["token_ids"] == want["token_ids"]
    messages, want_chat = reference["chat"]
    got = client.generate(messages=messages, sampling_params=GREEDY)
    assert (got["token_ids"], got["text"]) == (want_chat["token_ids"], want_chat["text"])


async def _stream_all(endpoint: str, prompts: list[str]) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """Every prompt streamed by a client of its own (a socket each), and the first 16 also
    without streaming, all over one more client; all at once."""
    clients = [AsyncClient(endpoint) for _ in range(len(prompts) + 1)]

    async def stream(client: AsyncClient, prompt: str) -> list[dict[str, Any]]:
        return [reply async for reply in client.stream(prompt, sampling_params=GREEDY)]

    try:
        streams = [stream(c, p) for c, p in zip(clients, prompts)]
        whole = [clients[-1].generate(p, sampling_params=GREEDY) for p in prompts[:16]]
        results = await asyncio.wait_for(asyncio.gather(*streams, *whole), timeout=240)
    finally:
        for c in clients:
            c.close()
    return list(results[:len(prompts)]), list(results[len(prompts):])


def test_64_concurrent_streams_are_complete_and_correct(server: ServerProcess, client: Client,
                                                        reference: dict[str, Any]) -> None:
    prompts = CONCURRENT_PROMPTS
    streams, whole = asyncio.run(_stream_all(server.zmq, prompts))
    tokenizer = reference["tokenizer"]
    for prompt, chunks in zip(prompts, streams):
        want = reference["prompts"][prompt]
        assert [c["finished"] for c in chunks] == [False] * (len(chunks) - 1) + [True], prompt  # exactly once, last
        ids = [t for c in chunks for t in c["token_ids"]]
        text = "".join(c["text"] for c in chunks)
        assert ids == want["token_ids"], prompt
        assert text == want["text"], prompt
        assert text == tokenizer.decode(ids, skip_special_tokens=True), prompt
        assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
        assert chunks[-1]["finish_reason"] == want["finish_reason"]
    for prompt, chunks, reply in zip(prompts, streams, whole):
        assert reply["text"] == "".join(c["text"] for c in chunks), prompt
        assert reply["token_ids"] == [t for c in chunks for t in c["token_ids"]], prompt
    assert_pages_free(client.admin("stats")["result"])


def test_one_sockets_streams_come_batched_as_frames_of_one_message(server: ServerProcess,
                                                                   reference: dict[str, Any]) -> None:
    """Streams sharing a socket get each step's updates as the frames of one multipart message
    (one send a step, not one a stream); every frame is a reply map, so a reader that takes
    frames one by one sees exactly what it saw before, and no update is lost or reordered."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.zmq)
    prompts = PROMPTS[:4]
    try:
        for i, prompt in enumerate(prompts):
            sock.send(msgpack.packb({"rid": f"batched-{i}", "text": prompt, "sampling_params": GREEDY,
                                     "stream": True}))
        chunks: dict[str, list[dict[str, Any]]] = {f"batched-{i}": [] for i in range(len(prompts))}
        frames_per_message = []
        while not all(c and c[-1]["finished"] for c in chunks.values()):
            assert sock.poll(60_000), "no reply within 60 s"
            frames = sock.recv_multipart()
            frames_per_message.append(len(frames))
            for frame in frames:
                reply = msgpack.unpackb(frame, raw=False)
                chunks[reply["rid"]].append(reply)
    finally:
        sock.close()
    assert max(frames_per_message) > 1, frames_per_message  # the streams decode in the same steps
    for i, prompt in enumerate(prompts):
        got = chunks[f"batched-{i}"]
        assert [c["finished"] for c in got] == [False] * (len(got) - 1) + [True], prompt
        assert [t for c in got for t in c["token_ids"]] == reference["prompts"][prompt]["token_ids"], prompt


def test_a_repeated_prefix_comes_from_the_cache_with_the_same_output(client: Client, reference: dict[str, Any]) -> None:
    first, second = (client.generate(p, sampling_params=GREEDY) for p in CACHE_PROMPTS)
    prefix_len = len(reference["tokenizer"].encode(CACHE_PREFIX))
    assert first["usage"]["cached_tokens"] < prefix_len // 2
    assert second["usage"]["cached_tokens"] >= prefix_len - 1  # the last token may merge with what follows
    for prompt, got in zip(CACHE_PROMPTS, (first, second)):
        assert got["token_ids"] == reference["prompts"][prompt]["token_ids"]


# ---- aborts ----------------------------------------------------------------------------------------------
def test_an_abort_ends_the_stream_and_frees_its_pages(client: Client) -> None:
    rid = "abort-me"
    chunks = []
    for reply in client.stream("Count to a million:", sampling_params=LONG, rid=rid):
        chunks.append(reply)
        if len(chunks) == 3:
            client.abort(rid)
    final = chunks[-1]
    assert (final["finished"], final["finish_reason"]) == (True, "abort")
    assert [c["finished"] for c in chunks].count(True) == 1
    assert 3 <= final["usage"]["completion_tokens"] < 100
    assert_pages_free(client.admin("stats")["result"])


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(server: ServerProcess, client: Client) -> None:
    before = client.admin("stats")["result"]
    gone = Client(server.zmq, timeout=60)
    replies = gone.stream("Tell me everything:", sampling_params=LONG)
    for _ in range(2):  # it is running
        next(replies)
    gone.close()  # ZMQ learns of it when the next token's reply cannot be delivered
    deadline = time.monotonic() + 30
    while (stats := client.admin("stats")["result"])["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["aborted"] == before["aborted"] + 1
    assert stats["decode_tokens"] - before["decode_tokens"] < 500  # stopped, not run to its 3000 tokens
    assert_pages_free(stats)
    assert any("aborted: the client disconnected" in line for line in server.read_log())


def test_a_client_that_disconnects_loses_every_stream_on_its_socket(server: ServerProcess, client: Client) -> None:
    """Its streams' updates travel in one message a step: the one that cannot be delivered
    aborts all of them, and their pages come back."""
    before = client.admin("stats")["result"]
    gone = Client(server.zmq, timeout=60)
    for i in range(3):
        gone.sock.send(msgpack.packb({"rid": f"gone-{i}", "text": "Tell me everything:", "sampling_params": LONG,
                                      "stream": True}))
    seen: set[str] = set()
    while len(seen) < 3:  # all three are running
        seen.add(recv(gone)["rid"])
    gone.close()
    deadline = time.monotonic() + 30
    while (stats := client.admin("stats")["result"])["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["aborted"] == before["aborted"] + 3
    assert stats["decode_tokens"] - before["decode_tokens"] < 3 * 500
    assert_pages_free(stats)


def test_a_duplicate_request_id_is_refused_while_the_first_runs(server: ServerProcess) -> None:
    with Client(server.zmq) as c:
        c.send_raw(msgpack.packb({"rid": "twin", "text": "Go on and on", "sampling_params": LONG, "stream": True}))
        assert "error" not in recv(c)  # the first is running
        c.send_raw(msgpack.packb({"rid": "twin", "text": "Me too", "sampling_params": {"max_tokens": 2}}))
        while "error" not in (reply := recv(c)):
            assert not reply["finished"]
        assert reply["rid"] == "twin"
        assert reply["error"]["message"] == "request id 'twin' is already in use"
        assert reply["error"]["param"] == "rid"
        c.abort("twin")  # the first was untouched: it still runs, until aborted
        while not (reply := recv(c))["finished"]:
            pass
        assert reply["finish_reason"] == "abort"


# ---- bad requests ----------------------------------------------------------------------------------------
def packed(**fields: Any) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


# (payload, what the error message must say, error type, param)
BAD_REQUESTS = {
    "malformed bytes": (b"\xc1\x00\xff", "malformed msgpack", "invalid_request", None),
    "truncated msgpack": (packed(text="hello")[:-2], "malformed msgpack", "invalid_request", None),
    "not a map": (msgpack.packb(["text", "hello"]), "expected a msgpack map, got list", "invalid_request", None),
    "extension type": (packed(text=msgpack.ExtType(3, b"x")), "extension type 3 is not accepted",
                       "invalid_request", None),
    "text as int": (packed(rid="r1", text=42), "text must be a string", "invalid_request", "text"),
    "temperature as string": (packed(rid="r2", text="hi", sampling_params={"temperature": "hot"}),
                              "temperature must be a number", "invalid_request", "sampling_params"),
    "SGLang name and ours": (packed(rid="r3", text="hi", sampling_params={"max_tokens": 3, "max_new_tokens": 3}),
                             "sets max_tokens twice", "invalid_request", "sampling_params"),
    "sampling_params not a map": (packed(text="hi", sampling_params=[1]), "sampling_params must be an object",
                                  "invalid_request", "sampling_params"),
    "missing prompt": (packed(rid="r4", sampling_params={}), "exactly one of 'text', 'input_ids' and 'messages'",
                       "invalid_request", None),
    "text and input_ids": (packed(rid="r5", text="hi", input_ids=[1, 2]),
                           "exactly one of 'text', 'input_ids' and 'messages'", "invalid_request", None),
    "out-of-vocabulary id": (packed(rid="r6", input_ids=[1, 8192]), "token id 8192 is outside the vocabulary [0, 8192)",
                             "invalid_request", "input_ids"),
    "negative id": (packed(input_ids=[-1]), "token id -1 is outside the vocabulary", "invalid_request", "input_ids"),
    "ids not ints": (packed(input_ids=["a"]), "input_ids must be a list of integers", "invalid_request", "input_ids"),
    "empty prompt": (packed(input_ids=[]), "the prompt is empty", "invalid_request", "prompt"),
    "stream not bool": (packed(text="hi", stream="yes"), "stream must be true or false", "invalid_request", "stream"),
    "rid not a string": (packed(rid=7, text="hi"), "rid must be a non-empty string", "invalid_request", "rid"),
    "unknown admin command": (packed(rid="a1", admin="reboot"), "admin must be one of stats, flush_cache, check_health",
                              "invalid_request", "admin"),
    "abort of an unknown id": (packed(rid="nobody", abort=True), "no request with id 'nobody' is in flight",
                               "not_found", "rid"),
    "prompt over the context length": (packed(rid="r7", input_ids=[5] * (CONTEXT_LEN + 4)),
                                       f"the prompt has {CONTEXT_LEN + 4} tokens, but the context length is "
                                       f"{CONTEXT_LEN}",
                                       "invalid_request", "prompt"),
    "prompt plus max_tokens over it": (packed(rid="r8", input_ids=[5] * 4000, sampling_params={"max_tokens": 200}),
                                       f"the prompt (4000 tokens) plus max_tokens (200) is 4200 tokens, over the "
                                       f"context length of {CONTEXT_LEN}", "invalid_request", "max_tokens"),
}


def rid_of(payload: bytes) -> str | None:
    try:
        sent = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    return sent["rid"] if isinstance(sent, dict) and isinstance(sent.get("rid"), str) else None


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_gets_an_error_naming_the_problem(client: Client, case: str) -> None:
    payload, message, kind, param = BAD_REQUESTS[case]
    client.send_raw(payload)
    reply = recv(client)
    assert "error" in reply, reply
    assert message in reply["error"]["message"]
    assert (reply["error"]["type"], reply["error"]["param"]) == (kind, param)
    if (rid := rid_of(payload)) is not None:
        assert reply["rid"] == rid  # so the client can tell which request failed
    assert client.generate("Still there?", sampling_params={"max_tokens": 2})["finished"]  # still serving


def test_after_every_failure_the_kv_pool_is_whole(client: Client) -> None:
    result = client.admin("check_health")
    assert result["ok"], result
    assert_pages_free(client.admin("stats")["result"])
