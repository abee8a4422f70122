"""Hugging Face transformers as the reference for our model and engine (float32, CPU).

Random small models have near-ties between their top logits, so engine outputs are checked
teacher-forced: HF runs once over prompt + the engine's output, and at every step the engine's
token must be within `tol` of HF's best logit there. Exact token equality with an HF greedy run
would fail on a tie that float rounding breaks the other way.

`PagedModel` drives our model forward by forward, the way the engine does, for logit comparisons.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from minisgl_mp.attention.base import AttentionContext, BatchLayout, ForwardMode
from minisgl_mp.attention import registry
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.registry import build_model
from minisgl_mp.models.source import ModelSource

# Torch's CPU threads spin while they wait; with more threads than free cores (the test
# machine has 2 cores shared with other runs) a tiny model's forward ran 20x slower.
TEST_THREADS = 1

# conftest's `make_checkpoint(overrides=None, *, seed=0, shards=1) -> Path` fixture.
MakeCheckpoint = Callable[..., Path]
# (logits row [V] of one step, every token before that step) -> the logits the engine samples from
LogitAdjust = Callable[[torch.Tensor, list[int]], torch.Tensor]


@contextlib.contextmanager
def torch_threads(n: int = TEST_THREADS) -> Iterator[None]:
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@functools.lru_cache(maxsize=16)
def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model for the checkpoint's architecture (Qwen3ForCausalLM, LlamaForCausalLM,
    ...) from the same folder, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {}
    if getattr(AutoConfig.from_pretrained(str(model_dir)), "num_experts", 0):
        # transformers' default for experts, torch's grouped_mm, takes no float64; its eager
        # loop is the reference semantics anyway.
        extra["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **extra).eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """Logits at every position of one sequence: [len(ids), V] in the model's dtype."""
    return model(torch.tensor([list(ids)], dtype=torch.int64)).logits[0]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation, recomputing the whole sequence each step (short sequences only: no
    dependence on HF's cache API); never stops early (no EOS)."""
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tokens.append(int(hf_logits(model, list(prompt) + tokens)[-1].argmax()))
    return tokens


def check_teacher_forced(model: torch.nn.Module, prompt: Sequence[int], output: Sequence[int],
                         tol: float = 1e-3, adjust: LogitAdjust | None = None) -> torch.Tensor:
    """Assert that every token of `output` was a best choice of HF's logits (after `adjust`, e.g.
    penalties) given the tokens before it, within `tol`. Returns HF's raw log-softmax at each
    output step: [len(output), V]."""
    prompt, output = list(prompt), list(output)
    if not output:
        raise AssertionError("the engine produced no tokens")
    logits = hf_logits(model, prompt + output[:-1])[len(prompt) - 1 :]
    for t, token in enumerate(output):
        row = logits[t] if adjust is None else adjust(logits[t].clone(), prompt + output[:t])
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if gap > tol:
            raise AssertionError(
                f"step {t}: engine chose token {token} (logit {float(row[token]):.5f}) but HF's best "
                f"is {best} (logit {float(row[best]):.5f}), {gap:.2e} higher; prompt {len(prompt)} "
                f"tokens, engine output {output}"
            )
    return torch.log_softmax(logits, dim=-1)


class PagedModel:
    """Our model with its own KV pool and page table, driven one forward at a time.

    Rows of the page table stand for requests; `lens[row]` tokens of each have KV in the pool.
    """

    def __init__(self, model: torch.nn.Module, max_reqs: int = 4, max_len: int = 256, seed: int = 0) -> None:
        cfg: ModelConfig = model.config
        dtype, cpu = next(model.parameters()).dtype, torch.device("cpu")
        self.model = model
        num_slots = max_reqs * max_len + 64  # some slots are never used
        self.pool = KVPool(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, cpu)
        self.table = ReqTable(max_reqs, max_len, cpu)
        gen = torch.Generator().manual_seed(seed)
        scattered = torch.randperm(num_slots, generator=gen)[: max_reqs * max_len]
        self.table.table.copy_(scattered.view(max_reqs, max_len))
        self.dtype = dtype
        self.use_backend("auto")
        self.lens = [0] * max_reqs

    def use_backend(self, name: str) -> None:
        """Attend through the backend called `name` (`auto`: the engine's default here)."""
        cfg: ModelConfig = self.model.config
        name = registry.resolve_name(name, torch.device("cpu"), self.dtype, self.dtype)
        self.backend = registry.create_backend(name, self.pool, self.table, cfg.num_heads, cfg.num_kv_heads,
                                               cfg.head_dim, self.dtype)

    def run(self, mode: ForwardMode, rows: Sequence[int], chunks: Sequence[Sequence[int]],
            logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run `chunks[i]` as the next tokens of request `rows[i]`; logits [sum of lens, V]
        (or the rows in logits_indices)."""
        cached = [self.lens[r] for r in rows]
        ext = [len(c) for c in chunks]
        out_loc = torch.cat([self.table.table[r, c : c + n] for r, c, n in zip(rows, cached, ext)])
        layout = BatchLayout(mode, torch.tensor(list(rows)), tuple(cached), tuple(ext), out_loc)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, ext)])
        with torch.inference_mode():
            attn = AttentionContext(self.backend, self.backend.prepare(layout))
            logits = self.model(ids, pos, attn, logits_indices)
        for r, n in zip(rows, ext):
            self.lens[r] += n
        return logits

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype = torch.float32) -> PagedModel:
        cfg = ModelConfig.from_file(model_dir / "config.json")
        source = ModelSource("test", model_dir / "config.json", model_dir, model_dir)
        return cls(build_model(source, cfg, dtype, torch.device("cpu"), progress=False))

    def reset(self) -> None:
        self.lens = [0] * len(self.lens)
