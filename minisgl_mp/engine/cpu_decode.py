"""All decoder layers of a CPU step in one C call (`--no-cpu-decode-plan` turns it off).

A decode step runs ~10 small kernels a layer, each behind a Python module and a ctypes wrapper.
At small batches the products are bound by reading the weights, and the rest of each call
(Python, argument checks, and the caches the weights just streamed through) costs more than
the work it wraps (docs/benchmarks.md section 21). kernels/csrc/decode_layers.c calls the same
kernels in the same order on the same inputs, so the outputs are the modules' own, bit for bit;
this file checks once that a model is one it can run that way and lays out its weights'
addresses.

It takes the layers of a float32 dense decoder of Qwen3's shape (per-head q/k norms), Llama's
or Qwen2's (no q/k norms; biases on the products): fused qkv and gate/up projections, no
tensor parallelism, every product, norm and rotation running a C kernel, over
the `cpu` attention backend. Steps with prompt chunks are taken too, mixed with decodes or not
(a mixed step paid the modules' Python calls once more than a decode step, docs/benchmarks.md
section 26), as long as every request's attention runs a C kernel (not the `sdpa` fallback)
and every product takes the step's rows in C: float32 panels without oneDNN's copy and bfloat16
tiles at any size, stored float16 / bfloat16 / int8 / int4 weights below `Linear.DENSE_MIN_ROWS`,
panels beside oneDNN's copy up to `Linear.PANELS_MAX_ROWS`. Anything else runs through the
modules, as before: the model files stay the math.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from minisgl_mp.attention.base import AttentionContext
from minisgl_mp.attention.cpu import CpuBackend, CpuMetadata, KernelRun
from minisgl_mp.kernels import cpu as cpu_kernels
from minisgl_mp.kvcache.pool import KVPool
from minisgl_mp.layers.linear import Linear
from minisgl_mp.layers.mlp import GatedMLP
from minisgl_mp.models.decoder import DecoderLayer, DecoderLM
from minisgl_mp.layers.norm import RMSNorm
from minisgl_mp.models.llama import LlamaAttention
from minisgl_mp.models.qwen3 import Qwen3Attention

logger = logging.getLogger(__name__)

_i64, _vp, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_FMT_AMX = 4  # decode_layers.c: a product over csrc/amx_gemm.c's tiles
_FMT_BF16DOT = 5  # decode_layers.c: a product over csrc/bf16dot_gemm.c's panels
_FMT_VNNI = 7  # decode_layers.c: csrc/vnni_gemm.c's int8 layout; int4's is _FMT_VNNI + 1


class _Product(ctypes.Structure):  # dl_product
    _fields_ = [("w", _vp), ("scale", _vp), ("bias", _vp), ("n", _i64), ("k", _i64), ("fmt", _i64)]


class _Layer(ctypes.Structure):  # dl_layer
    _fields_ = [("in_norm", _vp), ("post_norm", _vp), ("q_norm", _vp), ("k_norm", _vp), ("eps", _f32),
                ("qk_eps", _f32), ("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("k_pool", _vp), ("v_pool", _vp)]


class _Run(ctypes.Structure):  # dl_run
    _fields_ = [("kv_index", _vp), ("stride", _i64), ("batch", _i64), ("q_start", _vp), ("q_len", _vp),
                ("kv_len", _vp)]

    @classmethod
    def of(cls, run: KernelRun | None) -> _Run:
        if run is None:
            return cls(None, 0, 0, None, None, None)
        return cls(run.kv_index.data_ptr(), run.kv_index.shape[1], run.q_start.numel(), run.q_start.data_ptr(),
                   run.q_len.data_ptr(), run.kv_len.data_ptr())


_EXT_F32, _EXT_AMX, _EXT_BF16DOT = 0, 1, 2  # decode_layers.c: which blocked kernel takes prompt chunks


class _Step(ctypes.Structure):  # dl_step
    _fields_ = [("m", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("inter", _i64),
                ("kv_bf16", _i64), ("cos_sin", _vp), ("pos", _vp), ("out_loc", _vp), ("paged", _Run),
                ("extend", _Run), ("key_splits", _i64), ("extend_kind", _i64), ("scale", _f32), ("unused", _f32),
                ("bufs", _vp * 3), ("h", _vp), ("qkv", _vp), ("q", _vp), ("k", _vp), ("attn", _vp),
                ("gate_up", _vp), ("act", _vp)]


def _ptr(t: torch.Tensor | None, keep: list[torch.Tensor]) -> int | None:
    """t's address, with t kept alive in `keep` for as long as the plan points at it."""
    if t is None:
        return None
    keep.append(t)
    return t.data_ptr()


def _product(m: Linear, keep: list[torch.Tensor]) -> _Product | None:
    """The C product a module runs for fewer than DENSE_MIN_ROWS rows, or None (another path)."""
    if type(m) is not Linear or not m.cpu_gemm:
        return None
    if m.amx is not None:
        a = m.amx
        return _Product(_ptr(a.packed, keep), None, _ptr(a.bias, keep), m.out_features, m.in_features, _FMT_AMX)
    if m.bf16dot is not None:
        d = m.bf16dot
        return _Product(_ptr(d.packed, keep), None, _ptr(d.bias, keep), m.out_features, m.in_features, _FMT_BF16DOT)
    if m.vnni is not None:
        v = m.vnni
        return _Product(_ptr(v.packed, keep), _ptr(v.scale, keep), _ptr(v.bias, keep), m.out_features, m.in_features,
                        _FMT_VNNI + v.fmt)
    if m.panels is not None:
        bias = None if m.bias is None else m.bias.data
        return _Product(_ptr(m.panels.panels, keep), None, _ptr(bias, keep), m.out_features, m.in_features, -1)
    if m.stored is not None:
        s = m.stored
        return _Product(_ptr(s.weight, keep), _ptr(s.scale, keep), _ptr(s.bias, keep), m.out_features,
                        m.in_features, s.fmt)
    return None


def _head_norms(attn: torch.nn.Module) -> tuple[RMSNorm | None, RMSNorm | None]:
    """Qwen3's per-head q and k norms; (None, None) for Llama's and Qwen2's attention."""
    return (attn.q_norm, attn.k_norm) if isinstance(attn, Qwen3Attention) else (None, None)


def _row_limit(m: Linear) -> str | None:
    """Which of Linear's thresholds bounds the rows its C product takes: "panels" (beside
    oneDNN's copy, up to PANELS_MAX_ROWS), "stored" (below DENSE_MIN_ROWS), None (every batch)."""
    if m.amx is not None or m.bf16dot is not None or m.vnni is not None:
        return None
    if m.panels is not None:
        return None if m.packed_weight is None else "panels"
    return "stored"


class CpuDecodePlan:
    """`plan(x, positions, attn)` runs every layer on the embeddings x and returns (x, residual)
    as the layer loop would, or None when this step is not one it takes."""

    def __init__(self, model: DecoderLM, backend: CpuBackend, pool: KVPool, lib: ctypes.CDLL,
                 layers: list[_Layer], keep: list[torch.Tensor], row_limits: set[str]) -> None:
        cfg = model.config
        self.backend, self.lib = backend, lib
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.kv_bf16 = pool.k.dtype == torch.bfloat16
        self.cos_sin = model.rotary.cos_sin
        self.layers = (_Layer * len(layers))(*layers)
        self.num_layers = len(layers)
        # Every tensor the layers' addresses point into (weights, norms, the pool), held so none
        # is freed while the plan lives, even if a module were given a new weight.
        self._keep = keep
        self._row_limits = row_limits

    @property
    def max_rows(self) -> int | None:
        """The most rows a step may have for every product to run its C kernel, as the modules'
        own dispatch decides it (read at each step: a benchmark may move Linear's thresholds)."""
        limits = {"stored": Linear.DENSE_MIN_ROWS - 1, "panels": Linear.PANELS_MAX_ROWS}
        return min((limits[name] for name in self._row_limits), default=None)

    @classmethod
    def build(cls, model: torch.nn.Module, backend: object, pool: KVPool) -> CpuDecodePlan | None:
        """The plan for this model, or None (logged) when it is not one the C loop runs."""
        why = cls._unsupported(model, backend, pool)
        lib = cpu_kernels.load()
        if why is None and lib is None:
            why = "no C kernels"
        if why is not None:
            logger.info("decode steps run layer by layer through the modules: %s", why)
            return None
        assert isinstance(model, DecoderLM) and isinstance(backend, CpuBackend)
        layer_bytes = pool.k.stride(0) * pool.k.element_size()
        keep: list[torch.Tensor] = [pool.k, pool.v]
        layers = []
        row_limits: set[str] = set()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, *_head_norms(attn))
            layers.append(_Layer(
                *(None if n is None else _ptr(n.weight.data, keep) for n in norms), layer.input_layernorm.eps,
                0.0 if norms[2] is None else norms[2].eps,
                *(_product(m, keep) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                pool.k.data_ptr() + i * layer_bytes, pool.v.data_ptr() + i * layer_bytes))
            row_limits.update(filter(None, map(_row_limit, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                            mlp.down_proj))))
        lib.decode_layers.restype = ctypes.c_int
        lib.decode_layers.argtypes = [_vp, _i64, ctypes.POINTER(_Step)]
        logger.info("steps run their %d layers in one C call each", len(layers))
        return cls(model, backend, pool, lib, layers, keep, row_limits)

    @staticmethod
    def _unsupported(model: torch.nn.Module, backend: object, pool: KVPool) -> str | None:
        if not isinstance(model, DecoderLM) or not isinstance(backend, CpuBackend):
            return "not a decoder over the cpu attention backend"
        if pool.k.device.type != "cpu" or pool.k.dtype not in cpu_kernels.KV_DTYPES:
            return f"a {pool.k.dtype} pool on {pool.k.device}"
        cfg = model.config
        if not model.rotary.cpu_kernels:
            return "a rotary table without its C kernel (float32 only)"
        for layer in model.layers:
            if type(layer) is not DecoderLayer or type(layer.self_attn) not in (Qwen3Attention, LlamaAttention) \
                    or type(layer.mlp) is not GatedMLP:
                return (f"{type(layer.self_attn).__name__} / {type(layer.mlp).__name__} layers "
                        "(the C loop has Qwen3's, Llama's and Qwen2's dense layers)")
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = _head_norms(attn)
            norms = [n for n in (layer.input_layernorm, layer.post_attention_layernorm, q_norm, k_norm) if n is not None]
            if not all(n.cpu_kernels and n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms):
                return "norms without their C kernels (float32 only)"
            if layer.input_layernorm.eps != layer.post_attention_layernorm.eps or (
                    q_norm is not None and q_norm.eps != k_norm.eps):
                return "norms of one layer with different eps"
            if not mlp.cpu_kernels:
                return "SwiGLU without its C kernel"
            products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(_product(m, []) is None for m in products):
                return "products without their C kernels"
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
                return "layers with their own head counts (tensor parallel shards)"
        if cfg.head_dim % 2 or cfg.head_dim > 1024:
            return f"head_dim {cfg.head_dim}"
        return None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        md = attn.metadata
        m = x.shape[0]
        max_rows = self.max_rows
        if (attn.backend is not self.backend or not isinstance(md, CpuMetadata) or md.rest is not None
                or (md.kernel is None and md.extend is None) or m == 0 or (max_rows is not None and m > max_rows)):
            return None  # attention outside the C kernels, or rows some product takes elsewhere
        if (x.dtype != torch.float32 or x.shape[1] != self.hidden or not x.is_contiguous()
                or positions.dtype != torch.int64 or not positions.is_contiguous()
                or md.out_loc.dtype != torch.int64 or not md.out_loc.is_contiguous()):
            return None  # unexpected inputs
        qkv_n = (self.hq + 2 * self.hkv) * self.d
        bufs = (x, torch.empty_like(x), torch.empty_like(x))
        h = torch.empty_like(x)
        qkv = x.new_empty((m, qkv_n))
        q = x.new_empty((m, self.hq * self.d))
        k = x.new_empty((m, self.hkv * self.d))
        out = x.new_empty((m, self.hq * self.d))
        gate_up = x.new_empty((m, 2 * self.inter))
        act = x.new_empty((m, self.inter))
        paged = md.kernel
        # As CpuBackend.forward calls its kernels: the paged one's key splits from its own batch.
        key_splits = cpu_kernels.default_key_splits(paged.q_start.numel()) if paged is not None else 1
        kind = _EXT_AMX if self.backend.extend_amx else _EXT_BF16DOT if self.backend.extend_dot else _EXT_F32
        step = _Step(m, self.hidden, self.hq, self.hkv, self.d, self.inter, int(self.kv_bf16),
                     self.cos_sin.data_ptr(), positions.data_ptr(), md.out_loc.data_ptr(), _Run.of(paged),
                     _Run.of(md.extend), key_splits, kind, self.backend.scale, 0.0,
                     (_vp * 3)(*(b.data_ptr() for b in bufs)), h.data_ptr(), qkv.data_ptr(), q.data_ptr(),
                     k.data_ptr(), out.data_ptr(), gate_up.data_ptr(), act.data_ptr())
        rc = self.lib.decode_layers(self.layers, self.num_layers, ctypes.byref(step))
        if rc == -2:
            raise RuntimeError("the blocked attention kernel for prompt chunks cannot take this step "
                               "(build, head dim or pool)")
        if rc < 0:
            raise MemoryError("a CPU attention kernel or a bfloat16 product could not allocate its scratch space")
        return bufs[rc // 4], bufs[rc % 4]
