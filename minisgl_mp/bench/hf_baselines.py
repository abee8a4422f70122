"""The Hugging Face baselines: `generate` on static batches, and continuous batching.

Static batches run to their longest request (a batch cannot retire a finished row), so each
batch generates its longest output for every row; only each request's own output counts as
useful. Prompts are left-padded. EOS is ignored: min_new_tokens = max_new_tokens.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm import tqdm

from minisgl_mp.bench.checkpoints import BenchModel


def load_hf_model(model: BenchModel, seed: int, device: str = "cpu", progress: bool = True) -> Any:
    """float32 transformers model of the config's architecture (Qwen3ForCausalLM, LlamaForCausalLM,
    ...): the engine's checkpoint when there is one, else random weights of the config's shape."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()

    weights = model.hf_weights_dir
    if weights is not None and weights.is_file():  # a GGUF file: transformers dequantizes it itself
        hf = AutoModelForCausalLM.from_pretrained(str(weights.parent), gguf_file=weights.name, dtype=torch.float32)
    elif weights is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        config = AutoConfig.from_pretrained(str(model.config_path))
        hf = AutoModelForCausalLM.from_config(config).to(torch.float32)
    return hf.to(device).eval()


def pad_id_of(hf: Any) -> int:
    pad = hf.config.pad_token_id
    if pad is None:
        eos = hf.config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return int(pad)


class HFStatic:
    """`generate` on consecutive static batches of `batch_size` prompts."""

    def __init__(self, hf: Any, batch_size: int, progress: bool = True) -> None:
        self.hf, self.batch_size, self.progress = hf, batch_size, progress
        self.pad = pad_id_of(hf)
        self.generated_tokens = 0  # rows x steps, padding rows' waste included

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
        from transformers import GenerationConfig

        outputs: list[list[int]] = []
        starts = range(0, len(prompts), self.batch_size)
        for s in tqdm(starts, desc=f"hf static bs={self.batch_size}", unit="batch", disable=not self.progress, leave=False):
            batch, lens = prompts[s:s + self.batch_size], out_lens[s:s + self.batch_size]
            width, steps = max(len(p) for p in batch), max(lens)
            # input_ids, attention_mask: [b, width], prompts right-aligned
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long, device=self.hf.device)
            mask = torch.zeros((len(batch), width), dtype=torch.long, device=self.hf.device)
            for i, p in enumerate(batch):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            cfg = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                                   pad_token_id=self.pad, eos_token_id=self.hf.config.eos_token_id)
            out = self.hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            new = out[:, width:]
            self.generated_tokens += new.numel()
            outputs += [new[i, :n].tolist() for i, n in enumerate(lens)]
        return outputs


class HFContinuous:
    """transformers' continuous batching (`ContinuousBatchingManager`, what `generate_batch`
    runs), with a per-request output length and EOS off (`eos_token_id=-1`)."""

    def __init__(self, hf: Any, max_batch_tokens: int, max_requests: int, page_size: int = 32,
                 progress: bool = True, timeout_s: float = 600.0) -> None:
        self.hf, self.progress, self.timeout_s = hf, progress, timeout_s
        self.max_batch_tokens, self.max_requests, self.page_size = max_batch_tokens, max_requests, page_size
        self.config: dict[str, Any] = {}

    def _cb_config(self, prompts: list[list[int]], out_lens: list[int]) -> Any:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # A KV cache for every request at once: sized like the engine's pool, not by the
        # (GPU-oriented) memory heuristics.
        pages = sum(-(-(len(p) + n) // self.page_size) for p, n in zip(prompts, out_lens)) + 4
        self.config = {"page_size": self.page_size, "num_blocks": pages, "max_batch_tokens": self.max_batch_tokens,
                       "max_requests_per_batch": self.max_requests}
        return ContinuousBatchingConfig(**self.config)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
        from transformers import GenerationConfig

        gen = GenerationConfig(do_sample=False, max_new_tokens=max(out_lens), eos_token_id=-1,
                               pad_token_id=pad_id_of(self.hf))
        results: dict[str, list[int]] = {}
        with self.hf.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=self._cb_config(prompts, out_lens),
                warmup=False) as manager:
            rids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, out_lens)]
            deadline = time.monotonic() + self.timeout_s
            with tqdm(total=len(rids), desc="hf continuous", unit="req", disable=not self.progress, leave=False) as bar:
                while len(results) < len(rids):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"continuous batching finished {len(results)} of {len(rids)} requests "
                                           f"in {self.timeout_s:.0f}s")
                    r = manager.get_result(timeout=1)
                    if r is None:
                        if not manager.is_running():
                            raise RuntimeError("the continuous batching thread stopped before finishing")
                        continue
                    if r.is_finished():
                        results[r.request_id] = list(r.generated_tokens)
                        bar.update(1)
        return [results[rid] for rid in rids]
