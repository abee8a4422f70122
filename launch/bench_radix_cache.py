"""Benchmark the radix prefix cache: match, insert, lock and evict on trees of growing size.

The claim to check: an evict costs in proportion to what it frees (times a log factor), not to
the size of the tree, because the evictable leaves are kept up to date instead of collected by
walking the whole tree on every call. So the evict cost per freed token should stay nearly flat
from 10k to 100k nodes (a heap's log factor and colder CPU caches), while a full-tree walk, the
least a scan-based evict pays per call, grows 10x.

    python launch/bench_radix_cache.py            # trees of 10k and 100k nodes
    python launch/bench_radix_cache.py --quick    # 1k and 10k, fewer repetitions
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Callable

import torch

from minisgl_mp.kvcache.radix_cache import RadixPrefixCache

RUN = 32  # tokens per node
FANOUT = 9  # branches under each shared prefix: one prefix node + 9 leaves = 10 nodes a group
VOCAB = 150_000


@dataclass(frozen=True)
class Result:
    nodes: int
    tokens: int
    build_s: float
    # Medians over calls: on a busy machine a few calls lose a whole scheduler time slice
    # (about 4 ms), which swamps a mean of microsecond calls; the _mean figure keeps them.
    match_us: float  # per match of a cached 64-token sequence
    insert_us: float  # per insert of a new 64-token sequence sharing a cached 32-token prefix
    lock_unlock_us: float  # per lock + unlock pair
    evict_us_per_call: float  # per call asking for 256 tokens (8 leaves)
    evict_us_per_token: float  # per freed token
    evict_us_per_token_mean: float
    full_walk_ms: float  # visiting every node once, the floor for a scan-based evict call
    check_integrity_ms: float


def build_tree(num_nodes: int, page_size: int, gen: torch.Generator):
    groups = num_nodes // (FANOUT + 1)
    cache = RadixPrefixCache(page_size=page_size, device="cpu")
    prefixes = torch.randint(VOCAB, (groups, RUN), generator=gen)
    branches = torch.randint(VOCAB, (groups, FANOUT, RUN), generator=gen)
    # Distinct first tokens, so the tree has exactly the shape described above.
    prefixes[:, 0] = torch.arange(groups)
    branches[:, :, 0] = torch.arange(FANOUT)
    sequences = []
    next_loc = 0
    start = time.perf_counter()
    for g in range(groups):
        for b in range(FANOUT):
            ids = torch.cat([prefixes[g], branches[g, b]])
            cache.insert_prefix(ids, torch.arange(next_loc, next_loc + len(ids)))
            next_loc += len(ids)
            sequences.append(ids)
    build_s = time.perf_counter() - start
    return cache, prefixes, sequences, next_loc, build_s


def time_calls(fn: Callable[[int], object], calls: int) -> list[float]:
    """Microseconds for each of fn(0) .. fn(calls - 1)."""
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1e6)
    return times


def bench(num_nodes: int, page_size: int, reps: int, evict_tokens: int, seed: int) -> Result:
    gen = torch.Generator().manual_seed(seed)
    cache, prefixes, sequences, next_loc, build_s = build_tree(num_nodes, page_size, gen)
    nodes = len(prefixes) * (FANOUT + 1)
    tokens = cache.size_info.total_tokens
    # Python's collector visits every tracked object now and then, a cost of the interpreter
    # that grows with the heap, not of the cache; frozen, the timings measure the cache.
    gc.collect()
    gc.freeze()

    picks = torch.randint(len(sequences), (reps,), generator=gen).tolist()
    match_us = median(time_calls(lambda i: cache.match_prefix(sequences[picks[i]]), reps))

    handles = [cache.match_prefix(sequences[p]).handle for p in picks]

    def lock_unlock(i: int) -> None:
        cache.lock(handles[i])
        cache.unlock(handles[i])

    lock_unlock_us = median(time_calls(lock_unlock, reps))

    new_tails = torch.randint(VOCAB, (reps, RUN), generator=gen)
    group_picks = torch.randint(len(prefixes), (reps,), generator=gen).tolist()
    new_ids = [torch.cat([prefixes[g], new_tails[i]]) for i, g in enumerate(group_picks)]
    new_locs = [next_loc + 2 * RUN * i + torch.arange(2 * RUN) for i in range(reps)]
    insert_us = median(time_calls(lambda i: cache.insert_prefix(new_ids[i], new_locs[i]), reps))

    start = time.perf_counter()
    walked = sum(1 for _ in cache._iter_nodes())  # noqa: SLF001 - the baseline being beaten
    full_walk_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    cache.check_integrity()
    check_integrity_ms = (time.perf_counter() - start) * 1e3
    if walked < nodes:
        raise RuntimeError(f"tree has {walked} nodes, expected at least {nodes}")

    # Same absolute amount at every tree size, in calls the size of a small batch's demand.
    per_call = 8 * RUN
    calls = evict_tokens // per_call
    freed = []
    evict_times = time_calls(lambda _: freed.append(len(cache.evict(per_call))), calls)
    cache.check_integrity()
    gc.unfreeze()

    return Result(
        nodes=nodes,
        tokens=tokens,
        build_s=build_s,
        match_us=match_us,
        insert_us=insert_us,
        lock_unlock_us=lock_unlock_us,
        evict_us_per_call=median(evict_times),
        evict_us_per_token=median(t / n for t, n in zip(evict_times, freed)),
        evict_us_per_token_mean=sum(evict_times) / sum(freed),
        full_walk_ms=full_walk_ms,
        check_integrity_ms=check_integrity_ms,
    )


# (field, decimals) for the printed table; the JSON has every field at full precision.
COLUMNS = [
    ("nodes", 0),
    ("tokens", 0),
    ("build_s", 2),
    ("match_us", 1),
    ("insert_us", 1),
    ("lock_unlock_us", 1),
    ("evict_us_per_call", 1),
    ("evict_us_per_token", 3),
    ("full_walk_ms", 1),
    ("check_integrity_ms", 1),
]


def print_table(results: list[Result]) -> None:
    print("  ".join(name for name, _ in COLUMNS))
    for r in results:
        row = asdict(r)
        print("  ".join(f"{row[name]:>{len(name)}.{dec}f}" for name, dec in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller trees, fewer repetitions")
    parser.add_argument("--sizes", type=int, nargs="+", help="tree sizes in nodes")
    parser.add_argument("--page-size", type=int, default=1, help="must divide 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results/radix_cache.json"))
    args = parser.parse_args()
    if RUN % args.page_size:
        parser.error(f"--page-size must divide {RUN}")
    sizes = args.sizes or ([1_000, 10_000] if args.quick else [10_000, 100_000])
    reps = 500 if args.quick else 5_000
    evict_tokens = 8_192 if args.quick else 65_536

    results = []
    for size in sizes:
        if size * RUN < 2 * evict_tokens:
            parser.error(f"a tree of {size} nodes is too small to evict {evict_tokens} tokens")
        results.append(bench(size, args.page_size, reps, evict_tokens, args.seed))
    print_table(results)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "radix_cache",
        "config": {
            "page_size": args.page_size,
            "tokens_per_node": RUN,
            "reps": reps,
            "evict_tokens": evict_tokens,
            "quick": args.quick,
            "torch": torch.__version__,
        },
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
