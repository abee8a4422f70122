"""The model on its device with its KV pool: turns a batch into logits."""

from __future__ import annotations

import importlib.util
import logging

import torch

from minisgl_mp.attention.base import AttentionContext, BatchLayout
from minisgl_mp.attention.cpu import CpuBackend
from minisgl_mp.engine.cpu_decode import CpuDecodePlan
from minisgl_mp.engine.cuda_graph import DecodeGraphRunner
from minisgl_mp.attention import registry
from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.kernels import int4
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.kvcache.req_table import ReqTable
from minisgl_mp.kvcache.sizing import plan_pool
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.parallel import apply_tp
from minisgl_mp.models.gguf import is_gguf
from minisgl_mp.models.registry import build_model
from minisgl_mp.models.config import ModelConfig
from minisgl_mp.models.source import ModelSource
from minisgl_mp.models.weight_format import store_weights
from minisgl_mp.utils.device import resolve_dtype

logger = logging.getLogger(__name__)


class ModelRunner:
    """`tp`: this rank's tensor-parallel group (None: the whole model on one device). Under
    TP the model holds this rank's heads and its slice of the KV pool; the logits are whole."""

    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, context_len: int, progress: bool = True,
                 weight_dtype: torch.dtype | None = None, tp: TPGroup | None = None) -> None:
        self.config = config
        self.model_config = model_config  # the whole model's
        self.device = device
        self.dtype = dtype
        self.context_len = context_len
        shard = tp.shard if tp is not None else None
        self.weight_dtype = weight_dtype or dtype
        # int4 from a GGUF file: its own 4-bit blocks, collected as the loader reads them.
        file_blocks = ({} if self.weight_dtype == int4.STORAGE_DTYPE and shard is None and source.weights is not None
                       and is_gguf(source.weights) else None)
        self.model = build_model(source, model_config, dtype, device, progress=progress, seed=config.seed,
                                 shard=shard, int4_blocks=file_blocks)
        if tp is not None:
            apply_tp(self.model, model_config, tp)
        if self.weight_dtype != dtype:
            stored = store_weights(self.model, self.weight_dtype, file_blocks)
            logger.info("stored %d weight tensors as %s", stored, "int4 blocks" if self.weight_dtype == int4.STORAGE_DTYPE
                        else str(self.weight_dtype).replace("torch.", ""))
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        if device.type == "cpu" and dtype == torch.float32 and config.cpu_small_gemm:
            gemm = sum(m.enable_cpu_gemm(amx=config.cpu_amx, bf16_dot=config.cpu_bf16_dot, vnni=config.cpu_vnni)
                       for m in linears)
            amx = sum(m.amx is not None for m in linears)
            dot = sum(m.bf16dot is not None for m in linears)
            vnni = sum(m.vnni is not None for m in linears)
            logger.info("C product kernel for %d linear layers%s%s%s", gemm, f" ({amx} on AMX tiles)" if amx else "",
                        f" ({dot} on AVX512-BF16 dot products)" if dot else "",
                        f" ({vnni} on AVX512-VNNI integer dot products)" if vnni else "")
        if device.type == "cpu" and config.cpu_prepack is not False:
            # By default only where the panels do not run every batch themselves.
            packed = sum(m.prepack() for m in linears if config.cpu_prepack or not m.panels_take_every_batch())
            if packed:
                logger.info("prepacked %d linear layers for oneDNN", packed)
        if device.type == "cpu" and dtype == torch.float32 and config.cpu_fused_ops and cpu_kernels.load() is not None:
            fused = sum(m.enable_cpu_kernels() for m in self.model.modules() if hasattr(m, "enable_cpu_kernels"))
            logger.info("C kernels for %d norm / rotary modules", fused)
        if device.type == "cuda" and config.cuda_fused_ops:
            if importlib.util.find_spec("triton") is None:
                logger.warning("triton is not installed: the layers' element-wise steps run as PyTorch ops")
            else:
                fused = sum(m.enable_triton_kernels() for m in self.model.modules()
                            if hasattr(m, "enable_triton_kernels"))
                logger.info("Triton kernels for %d norm / MLP modules", fused)

        mc = shard.rank_config(model_config) if shard is not None else model_config  # this rank's heads
        self.kv_dtype = dtype if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, device, None)
        plan = plan_pool(
            bytes_per_token=KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype),
            page_size=config.page_size, device=device, num_pages=config.num_pages,
            kv_cache_gb=config.kv_cache_gb, mem_fraction_static=config.mem_fraction_static,
            max_tokens_needed=config.max_running_requests * context_len,
        )
        # Every rank must see the same pool, or their scheduling decisions would part ways.
        self.num_pages = tp.min_int(plan.num_pages) if tp is not None else plan.num_pages
        logger.info(plan.describe(config.page_size))
        self.pool = KVPool(mc.num_layers, self.num_pages * config.page_size, mc.num_kv_heads,
                           mc.head_dim, self.kv_dtype, device, prefault=config.cpu_prefault_kv)
        self.req_table = ReqTable(config.max_running_requests, context_len, device, config.page_size)
        self.attention_backend = registry.resolve_name(config.attention_backend, device, dtype, self.kv_dtype)
        self.backend = registry.create_backend(self.attention_backend, self.pool, self.req_table, mc.num_heads,
                                               mc.num_kv_heads, mc.head_dim, dtype)
        if isinstance(self.backend, CpuBackend) and any(m.amx is not None for m in linears) \
                and self.backend.use_amx_extend():
            logger.info("prompt attention on AMX tiles, as the linear products")
        if isinstance(self.backend, CpuBackend) and any(m.bf16dot is not None for m in linears) \
                and self.backend.use_dot_extend():
            logger.info("prompt attention on AVX512-BF16 dot products, as the linear products")
        if hasattr(self.backend, "max_query") and config.speculative_algorithm is not None:
            # A verification's K + 1 query rows take the decode kernel (the C paged kernel on the
            # CPU, Triton's on CUDA): its rows give the same bits however they are batched,
            # which the prompt kernels do not.
            self.backend.max_query = max(self.backend.max_query, config.speculative_num_draft_tokens + 1)
        logger.info("attention backend %s, KV cache %s", self.attention_backend, str(self.kv_dtype).replace("torch.", ""))
        self.cpu_decode: CpuDecodePlan | None = None
        if device.type == "cpu" and config.cpu_decode_plan and tp is None:
            self.cpu_decode = CpuDecodePlan.build(self.model, self.backend, self.pool)
            if self.cpu_decode is not None:
                self.model.layer_runner = self.cpu_decode
        self.graphs: DecodeGraphRunner | None = None
        self.verify_graphs: DecodeGraphRunner | None = None  # speculative decoding's verify steps
        if device.type == "cuda" and not config.disable_cuda_graph and tp is not None:
            # Not yet checked: NCCL collectives inside a captured graph.
            logger.warning("tensor parallelism: decode runs eagerly, without CUDA graphs")
        elif device.type == "cuda" and not config.disable_cuda_graph:
            if hasattr(self.backend, "graph_metadata"):
                self.graphs = DecodeGraphRunner(self.model, self.backend, self.pool.pad_slot, config.graph_max_bs, device)
                self.graphs.capture(progress=progress)
                verify_bs = config.verify_graph_max_bs
                if verify_bs:
                    self.verify_graphs = DecodeGraphRunner(self.model, self.backend, self.pool.pad_slot, verify_bs,
                                                           device, config.speculative_num_draft_tokens + 1)
                    self.verify_graphs.pool = self.graphs.pool
                    self.verify_graphs.capture(progress=progress)
            else:
                logger.warning("the %s attention backend does not run in CUDA graphs: decode runs eagerly",
                               self.attention_backend)

    @torch.inference_mode()
    def forward(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor | None) -> torch.Tensor:
        # Checked here, on host lengths, not in the model: reading positions back would sync the
        # device every step (and the C rotary kernel indexes its table unchecked).
        if layout.batch_size and max(layout.seq_lens) > self.model.rotary.max_position:
            raise ValueError(f"position {max(layout.seq_lens) - 1} is past the model's {self.model.rotary.max_position}")
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None and graphs.can_run(layout):
                logits = graphs.replay(layout, input_ids, positions)
                return logits if logits_indices is None else logits[logits_indices]
        attn = AttentionContext(self.backend, self.backend.prepare(layout))
        return self.model(input_ids, positions, attn, logits_indices)
