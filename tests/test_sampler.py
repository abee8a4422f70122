"""The device-side sampler (minisgl_mp/scheduler/sampler.py) on the CPU, against the definitions
of what a request asked for: the counter hash behind every random draw, draws that follow the
softmax exactly (each one the inverse CDF of its own uniform number), top-k / top-p / min-p
keeping exactly the tokens their definitions allow whatever internal path the batch takes, a
seeded request's tokens not depending on the rest of the batch nor on retraction and resumption,
repetition / frequency / presence penalties, logit_bias, min_tokens, and log-probabilities of the
raw logits for the rows that asked for them."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence

import pytest
import torch

from hf_reference import torch_threads
from minisgl_mp.sampling_params import SamplingParams
from minisgl_mp.scheduler.req import Req
from minisgl_mp.scheduler.sampler import Sampler, counter_uniform, counter_uniform_ref
from minisgl_mp.scheduler import sampler as sampler_module

CPU = torch.device("cpu")

# One logits row over 8 tokens, its probabilities chosen so that no top-p or min-p boundary below
# is near a tie, the order by probability is not the order by id, and token 3 is impossible.
#   by probability: 1 (.30), 6 (.24), 4 (.16), 7 (.12), 2 (.09), 0 (.06), 5 (.03), 3 (0)
#   cumulative:         .30       .54      .70      .82      .91      .97      1.0
PROBS = torch.tensor([0.06, 0.30, 0.09, 0.0, 0.16, 0.03, 0.24, 0.12], dtype=torch.float64)
LOGITS = PROBS.log().float()  # log(0) = -inf


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads():
        yield


def make_req(params: SamplingParams, row: int, prompt: Sequence[int] = (1, 2, 3), output: Sequence[int] = (),
             eos_ids: frozenset[int] = frozenset()) -> Req:
    req = Req(f"r{row}", list(prompt), params, max_seq_len=10_000, eos_ids=eos_ids)
    req.token_ids += list(output)
    req.row = row
    return req


def bind_all(sampler: Sampler, reqs: Sequence[Req]) -> None:
    sampler.bind(list(reqs))


def step(sampler: Sampler, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
    """One decode step as the scheduler runs it: sample, read back, append to each request."""
    ids = sampler.sample(logits, reqs).resolve().token_ids
    for r, t in zip(reqs, ids):
        r.token_ids.append(t)
    return ids


def allowed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the parameters define, in float64: softmax at the temperature; top-k
    keeps the k most likely; top-p keeps the smallest prefix of the tokens by probability whose
    mass (after top-k's renormalisation) reaches top_p; min-p keeps p >= min_p * p_max."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True)
    if p.top_k > 0:
        probs[order[p.top_k:]] = 0
        probs /= probs.sum()
    if p.top_p < 1:
        by_prob = probs[order]
        mass_before = by_prob.cumsum(0) - by_prob
        probs[order[mass_before >= p.top_p]] = 0
        probs /= probs.sum()
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
        probs /= probs.sum()
    return probs


def penalized(logits: torch.Tensor, req: Req) -> torch.Tensor:
    """The penalties' definitions for one row, in float64 Python: repetition divides a positive
    logit (multiplies a negative one) of every token in the prompt or output; frequency subtracts
    f * (count in the output); presence subtracts p from every token in the output."""
    p = req.params
    out = logits.double().clone()
    if p.repetition_penalty != 1:
        for t in set(req.token_ids):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, n in Counter(req.output_ids).items():
        out[t] -= p.frequency_penalty * n + p.presence_penalty
    return out


# ---- the counter hash -----------------------------------------------------------------------

def test_counter_uniform_matches_its_python_reference() -> None:
    rng = random.Random(0)
    seeds = [0, 1, 2, 2**62, 2**63 - 1] + [rng.getrandbits(63) for _ in range(20)]
    positions = list(range(1001))
    got = counter_uniform(torch.tensor(seeds)[:, None], torch.tensor(positions)[None, :])
    want = torch.tensor([[counter_uniform_ref(s, i) for i in positions] for s in seeds], dtype=torch.float64)
    assert got.dtype == torch.float64
    assert torch.equal(got, want)
    assert got.min() > 0 and got.max() <= 1
    assert abs(got.mean().item() - 0.5) < 0.01
    assert len(set(got[:, 0].tolist())) == len(seeds), "different seeds start from the same number"


# ---- the draws follow the distribution --------------------------------------------------------

def draw(params: SamplingParams, companion: SamplingParams | None, n_rows: int = 1000, steps: int = 10,
         logits_row: torch.Tensor = LOGITS) -> tuple[torch.Tensor, list[Req], Sampler]:
    """[steps, n_rows] tokens drawn from `logits_row` by n_rows unseeded requests with `params`,
    batched with one request with `companion` (first in the batch) that changes the sampler's
    internal path."""
    reqs = [make_req(params, row=i) for i in range(n_rows)]
    batch = ([make_req(companion, row=n_rows)] if companion is not None else []) + reqs
    sampler = Sampler(logits_row.numel(), CPU, rows=n_rows + 1, seed=1)
    bind_all(sampler, batch)
    logits = logits_row.expand(len(batch), -1).contiguous()
    tokens = [sampler.sample(logits, batch).resolve().token_ids[len(batch) - n_rows:] for _ in range(steps)]
    return torch.tensor(tokens), reqs, sampler


def check_draws(tokens: torch.Tensor, reqs: list[Req], want: torch.Tensor) -> None:
    """The tokens drawn are exactly the allowed ones, at their frequencies, and each draw is the
    inverse CDF (over token ids) of its request's counter uniform at its output position."""
    vocab = want.numel()
    freq = torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()
    drawn = set(tokens.unique().tolist())
    allowed = set(want.nonzero().flatten().tolist())
    assert drawn == allowed, f"drew {sorted(drawn)}, the parameters allow {sorted(allowed)}"
    tv = 0.5 * (freq - want).abs().sum().item()
    assert tv < 0.02, f"frequencies {freq.tolist()} against {want.tolist()} (total variation {tv:.4f})"

    seeds = torch.tensor([r.sampling_seed for r in reqs])
    u = counter_uniform(seeds[None, :], torch.arange(tokens.shape[0])[:, None])  # [steps, n_rows]
    cdf = want.cumsum(0)
    expected = torch.searchsorted(cdf, u.contiguous()).clamp(max=vocab - 1)
    # Float32 against float64 may only disagree where u is within rounding of a boundary.
    near_boundary = (u[..., None] - cdf).abs().min(dim=-1).values < 1e-5
    wrong = (tokens != expected) & ~near_boundary
    assert not wrong.any(), f"{int(wrong.sum())} draws are not the inverse CDF of their uniform"


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax_and_never_pick_impossible_tokens(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    tokens, reqs, _ = draw(params, None, n_rows=2000)
    assert 3 not in tokens.tolist()
    check_draws(tokens, reqs, allowed_probs(LOGITS, params))


FILTERS = {
    "top_k=3": SamplingParams(top_k=3),  # {1, 6, 4}
    "top_k above vocab": SamplingParams(top_k=100),  # all possible tokens
    "top_p=0.8": SamplingParams(top_p=0.8),  # {1, 6, 4, 7}
    "top_k=4 then top_p=0.6": SamplingParams(top_k=4, top_p=0.6),  # {1, 6}: .54 < .6, but .66 after top-k
    "min_p=0.35": SamplingParams(min_p=0.35),  # {1, 6, 4, 7}: p >= .105
    "top_k=3 with min_p=0.6": SamplingParams(top_k=3, min_p=0.6),  # {1, 6}
    "top_p=0.8 at temperature 2": SamplingParams(temperature=2.0, top_p=0.8),
}
# A request batched with the ones under test, each sending the batch down another path: all
# rows with top-k (candidate top-k), some rows with top-k (threshold), any top-p (full sort), a
# greedy row (random rows sampled apart).
COMPANIONS = {
    "alone": None,
    "with top_k=2": SamplingParams(top_k=2),
    "with all tokens": SamplingParams(),
    "with top_p=0.5": SamplingParams(top_p=0.5),
    "with greedy": SamplingParams(temperature=0),
}


@pytest.mark.parametrize("companion", COMPANIONS.values(), ids=COMPANIONS.keys())
@pytest.mark.parametrize("params", FILTERS.values(), ids=FILTERS.keys())
def test_top_k_top_p_min_p_allow_exactly_the_defined_tokens(params: SamplingParams,
                                                             companion: SamplingParams | None) -> None:
    tokens, reqs, _ = draw(params, companion)
    check_draws(tokens, reqs, allowed_probs(LOGITS, params))


def test_expected_allowed_sets_are_what_the_comments_say() -> None:
    # Guards the fixture: the sets the definitions allow on LOGITS are the intended ones.
    def allowed(p: SamplingParams) -> set[int]:
        return set(allowed_probs(LOGITS, p).nonzero().flatten().tolist())

    assert allowed(FILTERS["top_k=3"]) == {1, 6, 4}
    assert allowed(FILTERS["top_p=0.8"]) == {1, 6, 4, 7}
    assert allowed(FILTERS["top_k=4 then top_p=0.6"]) == {1, 6}
    assert allowed(SamplingParams(top_p=0.6)) == {1, 6, 4}
    assert allowed(FILTERS["min_p=0.35"]) == {1, 6, 4, 7}
    assert allowed(FILTERS["top_k=3 with min_p=0.6"]) == {1, 6}


# ---- batch independence and seeds ----------------------------------------------------------------

V_BIG = 1000
STEPS = 30


def seeded_run(target: SamplingParams, others: list[SamplingParams], target_row: int = 0,
               steps: int = STEPS) -> list[int]:
    """The tokens of a request with `target` over fixed logits, batched with `others` (fresh
    random logits each step), the target second in the batch on page-table row `target_row`."""
    target_logits = torch.randn(V_BIG, generator=torch.Generator().manual_seed(0)) * 2
    gen = torch.Generator().manual_seed(1)
    rows = [r for r in range(len(others) + 1) if r != target_row] + [target_row]
    reqs = [make_req(p, row=rows[i]) for i, p in enumerate(others)]
    me = make_req(target, row=target_row)
    reqs.insert(min(1, len(reqs)), me)
    sampler = Sampler(V_BIG, CPU, rows=8, seed=len(others))
    bind_all(sampler, reqs)
    for _ in range(steps):
        logits = torch.randn(len(reqs), V_BIG, generator=gen) * 2
        logits[reqs.index(me)] = target_logits
        step(sampler, logits, reqs)
    return me.output_ids


TARGETS = {
    "temperature 2": SamplingParams(temperature=2.0, seed=77),
    "top_k=50": SamplingParams(temperature=2.0, seed=77, top_k=50),
    "top_k=200 and min_p=0.05": SamplingParams(temperature=2.0, seed=77, top_k=200, min_p=0.05),
}
BATCHES = {
    "all rows top-k": [SamplingParams(top_k=5), SamplingParams(top_k=20, temperature=0.7),
                       SamplingParams(top_k=100, temperature=1.3)],
    "some rows top-k": [SamplingParams(top_k=5), SamplingParams(), SamplingParams(min_p=0.1)],
    "a row with top-p": [SamplingParams(top_p=0.5), SamplingParams(top_k=10), SamplingParams()],
    "greedy rows": [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=1.0),
                    SamplingParams(temperature=1.0, seed=77)],
    "penalties and bias": [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
                           SamplingParams(logit_bias={3: 5.0}, presence_penalty=1.0),
                           SamplingParams(min_tokens=5, stop_token_ids=[0, 1, 2])],
}


@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_seeded_request_draws_the_same_tokens_in_any_batch(target: SamplingParams,
                                                           batch: list[SamplingParams]) -> None:
    alone = seeded_run(target, [])
    assert len(set(alone)) >= 10, f"too few distinct tokens to tell runs apart: {alone}"
    assert seeded_run(target, batch, target_row=3) == alone


def test_a_row_without_top_p_keeps_every_token_beside_one_with_it() -> None:
    """Over a real vocabulary (SmolLM2's 49,152 tokens) a float32 running sum of the sorted
    probabilities reaches 1 before the last tokens; a row that did not ask for top-p must not
    lose them, nor draw other tokens, because a neighbour in the batch asked for it."""
    vocab = 49_152
    probs = torch.softmax(torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 3, dim=-1)
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0])
    got = sampler_module._top_p(probs, top_p)
    assert torch.equal(got[[0, 2, 3]], probs[[0, 2, 3]])
    assert torch.equal(sampler_module._top_p_sorted(probs, top_p)[[0, 2, 3]], probs[[0, 2, 3]])
    assert 0 < (got[1] > 0).sum() < vocab

    # What that did to draws: 256 seeded requests over 8 steps, without and beside a top-p
    # row: cutting the tail would move about one draw in 200 of these.
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 4

    def draws(others: list[SamplingParams]) -> list[int]:
        n = 256
        reqs = [make_req(SamplingParams(temperature=1.0, seed=s), row=s) for s in range(n)]
        reqs += [make_req(p, row=n + i) for i, p in enumerate(others)]
        sampler = Sampler(vocab, CPU, rows=len(reqs))
        bind_all(sampler, reqs)
        return [t for _ in range(8) for t in step(sampler, logits.expand(len(reqs), -1).contiguous(), reqs)[:n]]

    alone = draws([])
    assert len(set(alone)) > 100
    assert draws([SamplingParams(top_p=0.5)]) == alone


def test_top_k_ties_at_the_kth_logit_do_not_make_draws_batch_dependent() -> None:
    # bf16 logits (a bf16 model's, read as float32) tie often; here the 3rd to 5th best tie, so
    # top_k=3 must pick among tied tokens, and must do so the same way whatever the batch.
    logits = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0])
    target = SamplingParams(temperature=1.0, top_k=3, seed=5)

    def run(others: list[SamplingParams]) -> list[int]:
        reqs = [make_req(target, row=0)] + [make_req(p, row=i + 1) for i, p in enumerate(others)]
        sampler = Sampler(8, CPU, rows=4)
        bind_all(sampler, reqs)
        return [step(sampler, logits.expand(len(reqs), -1).contiguous(), reqs)[0] for _ in range(200)]

    runs = {"alone (every row has a top-k)": run([]),
            "beside a row without top-k": run([SamplingParams()]),
            "beside a top-p row": run([SamplingParams(top_p=0.9)])}
    alone = next(iter(runs.values()))
    drawn = {name: sorted(set(tokens)) for name, tokens in runs.items()}
    assert all(tokens == alone for tokens in runs.values()), f"top_k=3 with a tie; tokens drawn: {drawn}"


def test_same_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    logits_row = torch.randn(V_BIG, generator=torch.Generator().manual_seed(2)) * 2
    seeds = [77, 77, 78]
    reqs = [make_req(SamplingParams(temperature=1.5, seed=s), row=i) for i, s in enumerate(seeds)]
    sampler = Sampler(V_BIG, CPU, rows=3)
    bind_all(sampler, reqs)
    for _ in range(STEPS):
        step(sampler, logits_row.expand(3, -1).contiguous(), reqs)
    a, b, c = (r.output_ids for r in reqs)
    assert [r.sampling_seed for r in reqs] == seeds
    assert a == b
    assert a != c
    assert sum(x != y for x, y in zip(a, c)) > STEPS // 2


def test_unseeded_requests_draw_their_seed_from_the_sampler_seed() -> None:
    logits_row = torch.randn(V_BIG, generator=torch.Generator().manual_seed(3)) * 2

    def run(sampler_seed: int) -> tuple[list[int | None], list[list[int]]]:
        reqs = [make_req(SamplingParams(temperature=1.5), row=i) for i in range(2)]
        sampler = Sampler(V_BIG, CPU, rows=2, seed=sampler_seed)
        bind_all(sampler, reqs)
        for _ in range(STEPS):
            step(sampler, logits_row.expand(2, -1).contiguous(), reqs)
        return [r.sampling_seed for r in reqs], [r.output_ids for r in reqs]

    seeds, outs = run(11)
    assert all(s is not None and 0 <= s < 2**63 for s in seeds)
    assert seeds[0] != seeds[1] and outs[0] != outs[1], "two unseeded requests drew the same tokens"
    assert run(11) == (seeds, outs)
    other_seeds, other_outs = run(12)
    assert other_seeds != seeds and other_outs != outs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=1.5, seed=9, top_p=0.95),
    SamplingParams(temperature=1.5, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5),
], ids=["unseeded", "seeded top-p", "unseeded with penalties"])
def test_resumed_request_continues_the_same_draws(params: SamplingParams) -> None:
    # A small vocabulary so that penalized tokens recur and the penalties change the draws.
    logits_row = torch.randn(16, generator=torch.Generator().manual_seed(4)) * 2

    def one(sampler: Sampler, req: Req, n: int) -> None:
        for _ in range(n):
            step(sampler, logits_row[None, :], [req])

    straight = make_req(params, row=0, prompt=(1, 2, 3, 3))
    sampler = Sampler(16, CPU, rows=4, seed=5)
    sampler.bind([straight])
    one(sampler, straight, 24)

    resumed = make_req(params, row=0, prompt=(1, 2, 3, 3))
    sampler = Sampler(16, CPU, rows=4, seed=5)
    sampler.bind([resumed])
    one(sampler, resumed, 10)
    seed = resumed.sampling_seed
    # Retracted: others are admitted meanwhile (drawing seeds, using its row), then it resumes
    # on another row with its tokens so far.
    others = [make_req(SamplingParams(temperature=1.0, frequency_penalty=2.0, repetition_penalty=2.0), row=r)
              for r in (0, 1)]
    bind_all(sampler, others)
    for _ in range(3):
        step(sampler, logits_row.expand(2, -1).contiguous(), others)
    resumed.row = 2
    sampler.bind([resumed])
    assert resumed.sampling_seed == seed
    one(sampler, resumed, 14)
    assert resumed.output_ids == straight.output_ids


# ---- penalties ---------------------------------------------------------------------------------

def test_penalties_match_their_definitions() -> None:
    vocab = 16
    gen = torch.Generator().manual_seed(5)
    cases = [  # (params, page-table row, prompt, output)
        (SamplingParams(repetition_penalty=1.5), 5, [1, 2, 3, 3], [3, 4, 4, 9]),
        (SamplingParams(frequency_penalty=0.5), 2, [1, 2, 3, 3], [3, 4, 4, 9, 4]),
        (SamplingParams(), 7, [1, 2, 3], [4, 5]),
        (SamplingParams(presence_penalty=0.7), 0, [6, 7], [7, 8, 8, 8]),
        (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.2), 3,
         [10, 11, 12], [12, 13, 13, 14, 0]),
        (SamplingParams(frequency_penalty=2.0, presence_penalty=-2.0), 1, [15], []),
    ]
    reqs = [make_req(p, row=row, prompt=prompt, output=out) for p, row, prompt, out in cases]
    sampler = Sampler(vocab, CPU, rows=8)
    bind_all(sampler, reqs)
    logits = torch.randn(len(reqs), vocab, generator=gen) * 2
    before = logits.clone()
    rows = torch.tensor([r.row for r in reqs])
    got, idx, prow = sampler._apply_constraints(logits, reqs, rows)
    assert torch.equal(logits, before), "the penalties changed the caller's logits"
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i].double(), penalized(logits[i], r), atol=1e-5, rtol=1e-5,
                                   msg=lambda m, i=i: f"request {i}: {m}")
    pen = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    assert idx.tolist() == pen
    assert prow.tolist() == [reqs[i].row for i in pen]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, frequency_penalty=0.6),
    SamplingParams(temperature=0, presence_penalty=1.0),
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
], ids=["frequency", "presence", "repetition", "all three"])
def test_greedy_with_penalties_follows_the_penalized_argmax(params: SamplingParams) -> None:
    vocab = 12
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(6))
    plain = make_req(SamplingParams(temperature=0), row=1, prompt=(0, 1))
    req = make_req(params, row=0, prompt=(0, 1))
    sampler = Sampler(vocab, CPU, rows=2)
    bind_all(sampler, [plain, req])
    want = []
    for _ in range(20):
        want.append(int(penalized(logits[1], req).argmax()))
        step(sampler, logits, [plain, req])
    assert req.output_ids == want
    assert len(set(want)) > 1, "the penalty never changed the greedy token"
    assert set(plain.output_ids) == {int(logits[0].argmax())}


def test_penalty_counts_follow_sampled_tokens_and_survive_rebinding() -> None:
    vocab = 10
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(7))
    reqs = [make_req(SamplingParams(temperature=1.5, frequency_penalty=0.4), row=1, prompt=(0, 9)),
            make_req(SamplingParams(temperature=1.5, repetition_penalty=1.3), row=0, prompt=(5,)),
            make_req(SamplingParams(temperature=1.5, presence_penalty=0.4, repetition_penalty=1.1), row=2,
                     prompt=(1, 1), output=(2, 2, 3))]
    sampler = Sampler(vocab, CPU, rows=6)
    bind_all(sampler, reqs)
    for _ in range(15):
        step(sampler, logits_row.expand(3, -1).contiguous(), reqs)
    s = sampler.state

    def counts(r: Req) -> list[int]:
        return torch.bincount(torch.tensor(r.output_ids), minlength=vocab).tolist()

    def seen(r: Req) -> list[bool]:
        return [t in r.token_ids for t in range(vocab)]

    for r in (reqs[0], reqs[2]):
        c = torch.tensor(counts(r), dtype=torch.float32)
        want = c * r.params.frequency_penalty + (c > 0) * r.params.presence_penalty
        torch.testing.assert_close(s.penalty[r.row], want)
        assert s.in_output[r.row].tolist() == [n > 0 for n in counts(r)]
    for r in (reqs[1], reqs[2]):
        assert s.seen[r.row].tolist() == seen(r)
    device_penalty = s.penalty[reqs[2].row].clone()
    device_seen = s.seen[reqs[2].row].clone()
    # Resumed on another row: rebuilt from the token history, the same as counted on the device.
    reqs[2].row = 4
    sampler.bind([reqs[2]])
    torch.testing.assert_close(s.penalty[4], device_penalty)
    assert torch.equal(s.seen[4], device_seen)


# ---- logit_bias and min_tokens -----------------------------------------------------------------

def test_logit_bias_forces_and_forbids_tokens_of_its_own_request_only() -> None:
    vocab = 32
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(8))
    best = int(logits_row.argmax())
    second = int(logits_row.topk(2).indices[1])
    forced = int(logits_row.argmin())
    reqs = [make_req(SamplingParams(temperature=1.0, logit_bias={forced: 100}), row=2),
            make_req(SamplingParams(temperature=0, logit_bias={best: -100}), row=0),
            make_req(SamplingParams(temperature=0), row=1),
            make_req(SamplingParams(temperature=0, logit_bias={str(second): 0.5}), row=3)]
    sampler = Sampler(vocab, CPU, rows=4)
    bind_all(sampler, reqs)
    logits = logits_row.expand(len(reqs), -1).contiguous()
    got, _, _ = sampler._apply_constraints(logits, reqs, torch.tensor([r.row for r in reqs]))
    assert got[0, forced] == logits_row[forced] + 100
    assert got[3, second] == logits_row[second] + 0.5
    for _ in range(20):
        step(sampler, logits, reqs)
    assert set(reqs[0].output_ids) == {forced}
    assert set(reqs[1].output_ids) == {second}
    assert set(reqs[2].output_ids) == {best}
    want = second if logits_row[second] + 0.5 > logits_row[best] else best
    assert set(reqs[3].output_ids) == {want}


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    vocab = 16
    logits_row = torch.zeros(vocab)
    logits_row[3], logits_row[5], logits_row[6] = 10.0, 9.0, 1.0  # stop token, EOS, a plain token
    eos = frozenset({5})
    greedy = dict(temperature=0, stop_token_ids=[3, 10_000])  # 10_000: an id past the logits
    reqs = [make_req(SamplingParams(min_tokens=3, **greedy), row=0, eos_ids=eos),
            make_req(SamplingParams(min_tokens=3, ignore_eos=True, **greedy), row=1, eos_ids=eos),
            make_req(SamplingParams(min_tokens=0, **greedy), row=2, eos_ids=eos),
            make_req(SamplingParams(min_tokens=3, **greedy), row=3, output=(7, 8, 9), eos_ids=eos),
            make_req(SamplingParams(min_tokens=4, temperature=1.0, stop_token_ids=[3]), row=4, eos_ids=eos)]
    sampler = Sampler(vocab, CPU, rows=5)
    bind_all(sampler, reqs)
    for _ in range(5):
        step(sampler, logits_row.expand(len(reqs), -1).contiguous(), reqs)
    assert reqs[0].output_ids == [6, 6, 6, 3, 3]
    assert reqs[1].output_ids == [5, 5, 5, 3, 3], "ignore_eos: EOS is no stop token, min_tokens leaves it"
    assert reqs[2].output_ids == [3] * 5
    assert reqs[3].output_ids == [7, 8, 9] + [3] * 5
    assert not {3, 5} & set(reqs[4].output_ids[:4])


# ---- log-probabilities ---------------------------------------------------------------------------

def test_logprobs_are_of_the_raw_logits_for_the_rows_that_asked() -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(9)
    reqs = [make_req(SamplingParams(temperature=1.0, logprobs=3, logit_bias={7: 8.0},
                                    presence_penalty=2.0, repetition_penalty=1.5), row=3, output=(1, 2)),
            make_req(SamplingParams(temperature=0), row=0),
            make_req(SamplingParams(temperature=0, logprobs=0, min_tokens=2, stop_token_ids=[4]), row=1),
            make_req(SamplingParams(temperature=1.0), row=2),
            make_req(SamplingParams(temperature=0.7, top_k=5, logprobs=20), row=4)]
    sampler = Sampler(vocab, CPU, rows=5)
    bind_all(sampler, reqs)
    for n in range(5):
        logits = torch.randn(len(reqs), vocab, generator=gen) * 3
        logits[2, 4] = 20.0  # the stop token, masked for two steps, is the raw logits' best
        raw = torch.log_softmax(logits.double(), dim=-1)
        result = sampler.sample(logits, reqs).resolve()
        assert result.logprobs[1] is None and result.logprobs[3] is None
        for i in (0, 2, 4):
            lp, tok, k = result.logprobs[i], result.token_ids[i], reqs[i].params.logprobs
            assert lp is not None
            assert lp.token_logprob == pytest.approx(raw[i, tok].item(), abs=1e-4)
            want_vals, want_ids = raw[i].topk(k)
            assert list(lp.top_ids) == want_ids.tolist()
            assert list(lp.top_logprobs) == pytest.approx(want_vals.tolist(), abs=1e-4)
        assert result.logprobs[2].top_ids == () and result.logprobs[2].top_logprobs == ()
        assert result.token_ids[2] == (4 if n >= 2 else int(logits[2].topk(2).indices[1]))
        for r, t in zip(reqs, result.token_ids):
            r.token_ids.append(t)


def test_logprobs_when_every_row_asks() -> None:
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(10))
    reqs = [make_req(SamplingParams(temperature=0, logprobs=2), row=0),
            make_req(SamplingParams(temperature=1.0, logprobs=5, frequency_penalty=1.0), row=1),
            make_req(SamplingParams(temperature=1.0, logprobs=0), row=2)]
    sampler = Sampler(vocab, CPU, rows=3)
    bind_all(sampler, reqs)
    raw = torch.log_softmax(logits.double(), dim=-1)
    result = sampler.sample(logits, reqs).resolve()
    for i, (r, lp, tok) in enumerate(zip(reqs, result.logprobs, result.token_ids)):
        assert lp.token_logprob == pytest.approx(raw[i, tok].item(), abs=1e-4)
        k = r.params.logprobs
        assert list(lp.top_ids) == raw[i].topk(k).indices.tolist()
        assert len(lp.top_logprobs) == k
    assert result.token_ids[0] == int(logits[0].argmax())


def test_top_p_on_its_candidates_equals_the_full_sort() -> None:
    """On the CPU top-p looks among the 1,024 most likely tokens first: peaked rows (nucleus
    inside) and flat rows (sorted whole) must both keep what a full sort keeps."""
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 20_000, generator=gen)
    logits[:3, :30] += 12  # peaked: the nucleus is a few dozen tokens
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.5, 0.9, 0.2])
    got = sampler_module._top_p(probs, top_p)
    want = sampler_module._top_p_sorted(probs, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want)
    assert (got[:3] > 0).sum(dim=-1).max() < 1024 < (got[3:5] > 0).sum(dim=-1).min()


def test_a_row_keeps_nothing_of_its_last_holders_penalties() -> None:
    """A request admitted to a row that a frequency-penalized request held before gets only its
    own penalties (here repetition alone): the row's frequency term is rewritten, not left over."""
    vocab = 16
    logits = torch.zeros(1, vocab)
    logits[0, 5] = 1.0
    before = make_req(SamplingParams(temperature=0, frequency_penalty=2.0), row=0, prompt=(1,), output=(5, 5, 5))
    sampler = Sampler(vocab, CPU, rows=2)
    bind_all(sampler, [before])
    assert step(sampler, logits, [before]) != [5]  # 5 is penalized by 6
    after = make_req(SamplingParams(temperature=0, repetition_penalty=1.5), row=0, prompt=(1,))
    bind_all(sampler, [after])
    assert step(sampler, logits, [after]) == [5]
