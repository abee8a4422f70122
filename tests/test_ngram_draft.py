"""speculative/ngram.py: what an n-gram draft proposes, and when a request stops drafting."""

from __future__ import annotations

import random

import pytest

from minisgl_mp.speculative.ngram import DraftPolicy, NgramIndex, SharedNgrams


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest earlier occurrence
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_a_passage_being_copied_is_drafted() -> None:
    passage = [5, 6, 7, 8, 9, 10, 11]
    idx = NgramIndex(2, 4)
    idx.extend([1, 2] + passage + [3, 4] + passage[:3])
    assert idx.draft(3) == [8, 9, 10]  # the copy goes on where the passage went on
    assert NgramIndex(2, 4).draft(3) == []


def test_longest_and_latest_match_wins_as_a_scan_would() -> None:
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        idx = NgramIndex(1, 3)
        split = rng.randrange(len(tokens) + 1)
        idx.extend(tokens[:split])
        idx.extend(tokens[split:])
        assert idx.draft(4) == _brute_force(tokens, 1, 3, 4), (trial, tokens)


def test_truncate_forgets_rejected_tokens() -> None:
    idx = NgramIndex(2, 2)
    idx.extend([1, 2, 3, 1, 2, 9, 9])
    idx.truncate(5)  # back to [1, 2, 3, 1, 2]
    assert idx.tokens == [1, 2, 3, 1, 2] and idx.draft(2) == [3, 1]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramIndex(3, 2)


def test_a_request_whose_drafts_fail_pauses_longer_each_time_and_resumes() -> None:
    p = DraftPolicy(4, patience=2)
    paused = []
    for _ in range(3):  # three rounds of two failed verifications
        p.record(4, 0)
        p.record(4, 0)
        steps = 0
        while not p.wants_draft():
            steps += 1
        paused.append(steps)
    assert paused == [4, 8, 16]
    p.record(4, 2)  # an accepted draft resets the backoff
    p.record(4, 0)
    p.record(4, 0)
    assert sum(1 for _ in iter(lambda: p.wants_draft(), True)) == 4


def test_the_draft_length_follows_acceptance() -> None:
    p = DraftPolicy(6)
    assert p.length == 6
    p.record(6, 2)  # partly accepted: one fewer
    p.record(5, 1)
    assert p.length == 4
    p.record(4, 4)  # all accepted: two more, up to the most
    assert p.length == 6
    p.record(6, 6)
    assert p.length == 6
    for _ in range(10):
        p.record(p.length, 0)
    assert p.length == 1


def test_finished_text_drafts_for_later_requests_and_old_text_is_forgotten() -> None:
    shared = SharedNgrams(n=3, capacity=8)
    shared.add([1, 2, 3, 4, 5, 6, 7])
    assert shared.draft([9, 9, 2, 3, 4], 2) == [5, 6]  # another request's text goes on
    assert shared.draft([3, 4], 2) == []  # shorter than n
    shared.add(list(range(100, 110)))  # 7 new n-grams: the oldest ones go
    assert len(shared) == 8
    assert shared.draft([1, 2, 3], 2) == [] and shared.draft([101, 102, 103], 3) == [104, 105, 106]
