"""Speculative decoding with n-gram drafts: which decoding requests draft in a step, and how
the step's logits accept or reject their drafts.

A request that drafts d_1..d_K runs K + 1 tokens in the step, [last token, d_1..d_K], through
the same paged attention as a short extend, and gets logits at each of them: row j scores the
token after d_j (row 0 the token after its last one). Its K + 1 KV slots are reserved like an
extend's; after verification the KV of the accepted drafts stays, and the pages past the next
token's slot go back to the pool at once, so the prefix cache and the page table only ever hold
accepted tokens.

Verification samples every row exactly as a decode at that output position would (greedy: the
argmax; random: the inverse CDF of the row's distribution at the request's (seed, position)
uniform), and accepts d_j while it equals row j-1's token; the first row that differs gives its
own token, and a fully accepted draft gets row K's as a bonus. An n-gram draft is a point mass,
and for a point mass this is rejection sampling: d is kept with probability p(d), and otherwise
the token drawn is distributed as p without d, renormalised. So the target distribution is kept,
and more: a seeded request's tokens are the ones it would sample without speculation, whatever
was drafted and whatever else is in the batch (up to the rounding of a different kernel's logits).
Requests whose next token depends on more than their logits and position (a grammar, penalties,
which count the tokens before) decode without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.kvcache.allocator import PageAllocator
from minisgl_mp.scheduler.req import Req, TokenLogprobs
from minisgl_mp.scheduler.sampler import Sampler, argmax_rows, counter_uniform, inverse_cdf
from minisgl_mp.speculative.ngram import DraftPolicy, NgramIndex, SharedNgrams
from minisgl_mp.utils.device import host_tensor

ALGORITHMS = ("NGRAM",)


@dataclass(frozen=True)
class Verified:
    """What a verification step gives one request: its new tokens (the accepted drafts, then
    the token its first rejected or its last row chose), their log-probabilities, and how many
    drafts were accepted."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    drafted: int
    accepted: int


@dataclass
class SpecState:
    """A request's drafting state: its n-gram index (built at its first draft) and policy, and
    what its verifications accepted (for meta_info and /metrics)."""

    index: NgramIndex
    policy: DraftPolicy
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens per verification step (accepted drafts + the step's own token), as SGLang's
        spec_accept_length; 0 before any."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class NgramSpeculator:
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, max_batch_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be at least 1, got {num_draft_tokens}")
        NgramIndex(min_window, max_window)  # validates the window sizes
        self.k, self.min_window, self.max_window = num_draft_tokens, min_window, max_window
        self.max_batch_tokens = max_batch_tokens
        self.shared = SharedNgrams(min(max(min_window, 4), max_window))

    def state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(NgramIndex(self.min_window, self.max_window), DraftPolicy(self.k))
        return req.spec

    @staticmethod
    def can_draft(req: Req) -> bool:
        p = req.params
        return req.grammar is None and not p.has_penalties and req.seq_len + 1 < req.max_seq_len

    def batch_drafts(self, num_decodes: int) -> bool:
        """Whether a step of `num_decodes` decodes drafts at all: a batch past max_batch_tokens
        does not, as there the step is bound by compute and extra tokens cost about what they
        could save."""
        return num_decodes * (self.k + 1) <= self.max_batch_tokens

    def may_draft(self, req: Req) -> bool:
        """Whether `req` could draft in its next step (not paused by its policy); changes nothing.
        Overlap scheduling reads a step's tokens before the next is scheduled only if so."""
        return self.can_draft(req) and (req.spec is None or req.spec.policy.pause == 0)

    def drafts(self, decodes: list[Req]) -> list[list[int]]:
        """Each decoding request's draft for this step ([] for none). A request whose last token
        is still unread (overlap scheduling: the step before is in flight) decodes plainly."""
        if not self.batch_drafts(len(decodes)):
            return [[] for _ in decodes]
        out = []
        for req in decodes:
            if not self.can_draft(req):
                out.append([])
                continue
            st = self.state(req)
            if not st.policy.wants_draft() or req.token_ids[-1] < 0:
                out.append([])
                continue
            idx = st.index
            if len(idx.tokens) > req.seq_len:
                idx.truncate(req.seq_len)
            idx.extend(req.token_ids[len(idx.tokens):])
            # The last draft token must leave room for the bonus token inside max_seq_len.
            room = req.max_seq_len - req.seq_len - 1
            k = min(st.policy.length, room)
            # Its own text first, unless another request's matches a longer suffix.
            n, draft = idx.match(k)
            if n < self.shared.n:
                draft = self.shared.draft(idx.tokens, k) or draft
            out.append(draft)
        return out

    def finished(self, req: Req) -> None:
        """A request ended normally: its text can draft for later requests."""
        self.shared.add(req.token_ids)

    def verify(self, logits: torch.Tensor, entries: list[tuple[Req, list[int]]], sampler: Sampler) -> list[Verified]:
        """logits: [sum(len(draft) + 1), V], each entry's rows in order."""
        dev, vocab = logits.device, logits.shape[1]
        owner, offsets, out_pos = [], [], []
        for i, (req, draft) in enumerate(entries):
            offsets.append(len(owner))
            owner += [i] * (len(draft) + 1)
            out_pos += range(req.output_len, req.output_len + len(draft) + 1)
        reqs = [entries[i][0] for i in owner]
        raw = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r, _ in entries) else None
        logits = _constrained(logits, reqs, out_pos, vocab)
        chosen = argmax_rows(logits)
        random_rows = [j for j, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            idx = host_tensor(random_rows, torch.int64, dev)
            rows = host_tensor([reqs[j].row for j in random_rows], torch.int64, dev)
            probs = sampler.probabilities(logits[idx], [reqs[j].params for j in random_rows], rows)
            pos = host_tensor([out_pos[j] for j in random_rows], torch.int64, dev)
            chosen[idx] = inverse_cdf(probs, counter_uniform(sampler.state.seed[rows], pos))
        tokens = chosen.tolist()
        results = []
        for i, (req, draft) in enumerate(entries):
            base = offsets[i]
            a = 0
            while a < len(draft) and tokens[base + a] == draft[a]:
                a += 1
            out = draft[:a] + [tokens[base + a]]
            results.append(Verified(out, _logprobs(raw, req, base, out), len(draft), a))
        return results


def _constrained(logits: torch.Tensor, reqs: list[Req], out_pos: list[int], vocab: int) -> torch.Tensor:
    """logit_bias and min_tokens (stop tokens masked before it), per row at its own output
    position, as the sampler applies them to a decode."""
    bias_rows, bias_ids, bias_vals, stop_rows, stop_ids = [], [], [], [], []
    for j, (r, pos) in enumerate(zip(reqs, out_pos)):
        for t, b in r.params.logit_bias:
            bias_rows.append(j), bias_ids.append(t), bias_vals.append(b)
        if pos < r.params.min_tokens and r.stop_ids:
            stop = [t for t in sorted(r.stop_ids) if 0 <= t < vocab]
            stop_rows += [j] * len(stop)
            stop_ids += stop
    if not (bias_rows or stop_rows):
        return logits
    dev = logits.device
    logits = logits.clone()
    if bias_rows:
        logits.index_put_((host_tensor(bias_rows, torch.int64, dev), host_tensor(bias_ids, torch.int64, dev)),
                          host_tensor(bias_vals, logits.dtype, dev), accumulate=True)
    if stop_rows:
        logits[host_tensor(stop_rows, torch.int64, dev), host_tensor(stop_ids, torch.int64, dev)] = float("-inf")
    return logits


def _logprobs(raw: torch.Tensor | None, req: Req, base: int, tokens: list[int]) -> list[TokenLogprobs | None]:
    """The log-probabilities (before the request's constraints, as the sampler reports them) of
    `tokens`, the j-th scored by row base + j."""
    k = req.params.logprobs
    if raw is None or k is None:
        return [None] * len(tokens)
    rows = raw[base:base + len(tokens)]
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    if not k:
        return [TokenLogprobs(c, (), ()) for c in chosen]
    vals, ids = rows.topk(k, dim=-1)
    return [TokenLogprobs(c, tuple(i), tuple(v)) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]


def release_rejected(req: Req, table: torch.Tensor, allocator: PageAllocator) -> None:
    """Give back the pages past the one that holds `req`'s next token's slot (its rejected
    drafts' KV), so the request holds no more than a plain decode would."""
    ps = allocator.page_size
    keep = -(-(req.computed_len + 1) // ps) * ps
    if req.alloc_len > keep:
        allocator.free_slots(table[req.row, keep:req.alloc_len].clone())
        req.alloc_len = keep


def rank0_verified(tp: TPGroup, entries: list[tuple[Req, list[int]]], verified: list[Verified]) -> list[Verified]:
    """Rank 0's verification on every rank, as for sampled tokens: the ranks drafted the same
    tokens (from the same histories), and must keep the same ones."""
    flat = []
    for (_, draft), v in zip(entries, verified):
        flat += [v.accepted, *v.tokens, *[-1] * (len(draft) + 1 - len(v.tokens))]
    flat = tp.broadcast_ints(flat)
    out, at = [], 0
    for (_, draft), v in zip(entries, verified):
        accepted = flat[at]
        tokens = flat[at + 1:at + 2 + accepted]
        at += len(draft) + 2
        lps = v.logprobs if accepted == v.accepted else [None] * len(tokens)
        out.append(Verified(tokens, lps, v.drafted, accepted))
    return out
