"""The --dp-size dispatcher on its own: prefix affinity, ties to the shortest queue, the load
guard, the bounded index, aborts to the right replica, and merged admin answers."""

from __future__ import annotations

import asyncio
from typing import Any

from minisgl_mp.message.messages import AbortReq, AdminReply, GenerateReq
from minisgl_mp.tokenizer.dispatch import BALANCE_ABS, BLOCK_TOKENS, PrefixIndex, ReplicaDispatcher
from minisgl_mp.tokenizer.manager import merge_replies


class FakeQueue:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def put(self, msg: Any) -> None:
        self.sent.append(msg)


def _dispatcher(n: int = 2, **kw: Any) -> tuple[ReplicaDispatcher, list[FakeQueue]]:
    queues = [FakeQueue() for _ in range(n)]
    return ReplicaDispatcher(queues, **kw), queues


def _submit(d: ReplicaDispatcher, rid: str, ids: list[int]) -> int:
    return asyncio.run(d.submit(GenerateReq(rid, ids, {})))


PREFIX_A = list(range(100, 100 + 4 * BLOCK_TOKENS))
PREFIX_B = list(range(500, 500 + 4 * BLOCK_TOKENS))


def test_a_shared_prefix_follows_its_first_request_and_others_go_to_the_shortest_queue() -> None:
    d, queues = _dispatcher()
    first = _submit(d, "a0", PREFIX_A + [1])
    other = _submit(d, "b0", PREFIX_B + [1])  # no match anywhere: the idle replica
    assert other != first
    # Even with its replica busier, a request with the cached prefix goes there.
    assert [_submit(d, f"a{i}", PREFIX_A + [i]) for i in range(1, 4)] == [first] * 3
    assert _submit(d, "b1", PREFIX_B + [7]) == other
    assert d.in_flight[first] == 4 and d.in_flight[other] == 2
    assert sum(len(q.sent) for q in queues) == 6


def test_ties_go_to_the_replica_with_fewer_requests_in_flight() -> None:
    d, _ = _dispatcher(3)
    assert [_submit(d, str(i), [i] * 3) for i in range(3)] == [0, 1, 2]  # short: nothing indexed
    d.release("1")
    assert _submit(d, "x", [9, 9]) == 1
    for rid in ("0", "2", "x"):
        d.release(rid)
    # Idle replicas: a new prefix goes where fewer prefixes are indexed.
    assert [_submit(d, f"p{i}", [i] * BLOCK_TOKENS) for i in range(3)] == [0, 1, 2]


def test_the_load_guard_overrules_the_prefix_when_one_replica_is_swamped() -> None:
    d, _ = _dispatcher()
    ranks = [_submit(d, f"r{i}", PREFIX_A + [i]) for i in range(BALANCE_ABS + 1)]
    assert set(ranks) == {0}
    assert _submit(d, "over", PREFIX_A + [99]) == 1  # 17 in flight against 0


def test_aborts_reach_the_replica_that_has_the_request_and_release_is_once() -> None:
    d, queues = _dispatcher()
    rank = _submit(d, "r", PREFIX_A)
    asyncio.run(d.abort("r"))
    assert isinstance(queues[rank].sent[-1], AbortReq) and queues[rank].sent[-1].rid == "r"
    assert d.release("r") == rank and d.release("r") is None
    assert d.in_flight == [0, 0]
    asyncio.run(d.abort("r"))  # over: nothing more is sent
    assert len(queues[rank].sent) == 2


def test_the_index_is_bounded_least_recent_first_and_forgotten_on_flush() -> None:
    index = PrefixIndex(max_blocks=4)
    a, b = PrefixIndex.keys(PREFIX_A), PrefixIndex.keys(PREFIX_B)
    index.insert(a)
    index.insert(b[:2])
    assert len(index) == 4 and index.match_blocks(a) == 0 and index.match_blocks(b) == 2
    d, _ = _dispatcher()
    _submit(d, "r", PREFIX_A)
    d.forget_prefixes()
    assert all(len(i) == 0 for i in d.indexes)


def test_merged_admin_replies_sum_counts_and_name_the_failing_replica() -> None:
    replies = [AdminReply("x-0", True, {"running": 1, "total_tokens": 100, "health_error": None}),
               AdminReply("x-1", False, {"running": 2, "total_tokens": 100, "health_error": "pages lost"})]
    merged = merge_replies("x", replies)
    assert not merged.ok
    assert merged.result["running"] == 3 and merged.result["total_tokens"] == 200
    assert merged.result["health_error"] == "dp rank 1: pages lost"
    assert [r["running"] for r in merged.result["dp_ranks"]] == [1, 2]
