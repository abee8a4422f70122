"""One forward's worth of work: which requests run how many tokens, as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_mp.attention.base import BatchLayout, ForwardMode
from minisgl_mp.scheduler.req import Req
from minisgl_mp.utils.device import host_tensor


@dataclass(frozen=True)
class ScheduledBatch:
    reqs: list[Req]
    extend_lens: list[int]
    # Per request: does this forward finish its extension, so a token is sampled from it?
    # (False for a chunk of a prompt that goes on in a later step.)
    sampled: list[bool]
    # Per request: is this a prefill (or a prefill chunk), rather than a one-token decode?
    prefill: list[bool]
    layout: BatchLayout
    input_ids: torch.Tensor
    positions: torch.Tensor
    # Rows of the batch's tokens that go through the LM head: first one per sampled request
    # (in `sampled_reqs` order), then every row of each verified draft (`verifies` order), then
    # the prompt positions of `prompt_logprob_spans`.
    logits_indices: torch.Tensor
    # (request, first position, count): prompt positions whose logits this forward returns
    # after the sampled rows, for prompt log-probabilities. Empty unless a request asked.
    prompt_logprob_spans: tuple[tuple[Req, int, int], ...] = ()
    # Some decode's input is the unread token of the step launched before (overlap
    # scheduling): -(k + 1) in `input_ids` stands for that step's k-th sampled token.
    has_futures: bool = False
    # Speculative decoding: (request, its draft) for each request that runs [last token] + draft
    # this step and is verified from all those rows' logits (neither sampled nor a prefill).
    verifies: tuple[tuple[Req, list[int]], ...] = ()

    @property
    def num_verify_rows(self) -> int:
        return sum(len(d) + 1 for _, d in self.verifies)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, p in zip(self.extend_lens, self.prefill) if p)

    @property
    def sampled_reqs(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sampled) if s]


def build_batch(decodes: list[Req], decode_locs: torch.Tensor | None,
                prefills: list[tuple[Req, int, torch.Tensor]], device: torch.device,
                verifies: list[tuple[Req, list[int], torch.Tensor]] = ()) -> ScheduledBatch:
    """decodes: requests running one token each, with the KV slot of each ([len(decodes)], one
    tensor for the group, from `CacheManager.reserve_decodes`); verifies: (request, its draft,
    the KV slots of its draft + 1 tokens); prefills: (request, tokens to run, their KV slots).
    The batch is the decodes, then the verifies, then the prefills, in the given orders."""
    nd = len(decodes)
    reqs = list(decodes)
    lens = [1] * nd
    prefill = [False] * nd
    sampled = [True] * nd  # a decode always finishes its one-token extension
    ids = [r.token_ids[r.computed_len] for r in decodes]
    pos = [r.computed_len for r in decodes]
    logit_rows = list(range(nd))
    locs = [decode_locs] if nd else []
    spans, span_rows = [], []
    offset = nd
    verify_rows = []
    for req, draft, out_loc in verifies:
        n = len(draft) + 1
        reqs.append(req)
        lens.append(n)
        prefill.append(False)
        sampled.append(False)
        ids += [req.token_ids[req.computed_len], *draft]
        pos.extend(range(req.computed_len, req.computed_len + n))
        locs.append(out_loc)
        verify_rows.extend(range(offset, offset + n))
        offset += n
    for req, n, out_loc in prefills:
        start = req.computed_len
        reqs.append(req)
        lens.append(n)
        prefill.append(True)
        ids.extend(req.token_ids[start : start + n])
        pos.extend(range(start, start + n))
        locs.append(out_loc)
        done = start + n == req.seq_len
        sampled.append(done)
        if req.wants_prompt_logprobs:
            first = max(start, req.prompt_logprob_pos)
            last = min(start + n, req.prompt_len - 1)
            if first < last:
                spans.append((req, first, last - first))
                span_rows.extend(range(offset + first - start, offset + last - start))
        offset += n
        if done:
            logit_rows.append(offset - 1)
    layout = BatchLayout(
        mode=ForwardMode.EXTEND if prefills or verifies else ForwardMode.DECODE,
        req_slots=host_tensor([r.row for r in reqs], torch.int64, device),
        prefix_lens=tuple(r.computed_len for r in reqs),
        extend_lens=tuple(lens),
        out_loc=locs[0] if len(locs) == 1 else torch.cat(locs),
    )
    return ScheduledBatch(
        reqs=reqs, extend_lens=lens, sampled=sampled, prefill=prefill, layout=layout,
        input_ids=host_tensor(ids, torch.int64, device),
        positions=host_tensor(pos, torch.int64, device),
        logits_indices=host_tensor(logit_rows + verify_rows + span_rows, torch.int64, device),
        prompt_logprob_spans=tuple(spans),
        has_futures=any(t < 0 for t in ids[:nd]),
        verifies=tuple((r, d) for r, d, _ in verifies),
    )
