"""What the scheduler process (or the offline engine) needs to run a model: one frozen config.

Every field's default is the CLI default too (see `utils/cli.py`): one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULE_POLICIES = ("fcfs", "lpm")
CACHE_TYPES = ("radix", "naive")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "cpu", "sdpa", "triton", "flashinfer")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("auto", "xgrammar", "none")
QUANTIZATIONS = (None, "int8", "int4")
DEFAULT_CUDA_GRAPH_MAX_BS = 256
DEFAULT_PREFILL_CHUNK = 8192
CPU_PREFILL_CHUNK = 2048


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata=_help("model folder, Hugging Face hub id, or short name (e.g. Qwen3-0.6B)"))
    tokenizer: str | None = field(default=None, metadata=_help("tokenizer folder (default: the model's)"))
    load_format: str = field(default="auto", metadata=_help("auto: load the checkpoint; dummy: random weights of the model's shape"))
    dtype: str = field(default="auto", metadata=_help("auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16. On CUDA the model runs in it; on CPU only the weights are stored in it (linear layers and embeddings), and activations, norms and the KV cache stay float32: products widen the weights in registers"))
    quantization: str | None = field(default=None, metadata=_help("int8: on CPU, linear and embedding weights stored as int8 with a float32 scale per output channel, quantized at load from the float checkpoint (activations stay float32); int4: as 4-bit blocks of 32 with a float16 scale and minimum each (llama.cpp's Q4_1), and from a GGUF file its Q4_0 / Q4_1 tensors as they are (its other tensors as int8)"))
    device: str | None = field(default=None, metadata=_help("cpu, cuda, cuda:N (default: cuda if available, else cpu)"))
    seed: int = field(default=0, metadata=_help("seed for unseeded sampling and dummy weights"))
    # KV cache
    page_size: int = field(default=1, metadata=_help("tokens per KV page"))
    num_pages: int | None = field(default=None, metadata=_help("KV pages in the pool (overrides --kv-cache-gb)"))
    kv_cache_gb: float | None = field(default=None, metadata=_help("KV pool size in GiB on CPU (default: 4, at most a quarter of free memory)"))
    mem_fraction_static: float = field(default=0.85, metadata=_help("on CUDA: fraction of GPU memory for weights plus KV pool"))
    kv_cache_dtype: str = field(default="auto", metadata=_help("KV cache dtype: auto (the model's), bfloat16 (half the memory and, on CPU, half the bytes each decode reads), float16, float32"))
    cache_type: str = field(default="radix", metadata=_help("prefix cache: radix or naive (no reuse)"))
    # Scheduling
    max_running_requests: int = field(default=256, metadata=_help("requests decoding at once"))
    max_prefill_tokens: int | None = field(default=None, metadata=_help("tokens prefilled in one step; longer prompts, and more prompts than fit, go on in later steps (SGLang's chunked prefill size). Default: 2048 on CPU, where a prefill runs faster in such chunks than in larger ones (docs/benchmarks.md section 17); 8192 on CUDA"))
    context_length: int | None = field(default=None, metadata=_help("max tokens per request, prompt plus output (default: the model's)"))
    schedule_policy: str = field(default="lpm", metadata=_help("fcfs or lpm (longest prefix match, with aging)"))
    schedule_aging_steps: int = field(default=32, metadata=_help("lpm: a request waiting this many rounds goes first"))
    mixed_batch: bool = field(default=True, metadata=_help("run decodes in the same step as a prefill chunk"))
    mixed_step_ratio: float | None = field(default=None, metadata=_help("while requests decode, size each step's prefill chunk so the step takes at most this many times a decode-only step (both measured as the engine runs), at least 32 tokens; keeps the inter-token latency of running requests bounded when prompts arrive. Default: 2 on CPU, off on CUDA (0: off); --max-prefill-tokens bounds every step either way"))
    max_prefill_streak: int = field(default=2, metadata=_help("without mixed batches: prefill steps in a row before decode runs"))
    attention_backend: str = field(default="auto", metadata=_help("auto (cpu on the CPU; flashinfer on CUDA when installed, else triton), cpu (the C paged kernel), sdpa (PyTorch), triton, flashinfer"))
    cuda_graph_max_bs: int | None = field(default=None, metadata=_help("on CUDA: largest decode batch run through a captured CUDA graph (default: 256, at most --max-running-requests)"))
    disable_cuda_graph: bool = field(default=False, metadata=_help("on CUDA: run decode steps eagerly, without CUDA graphs"))
    cuda_fused_ops: bool = field(default=True, metadata=_help("on CUDA, Triton kernels for each layer's add+RMSNorm, q/k norm+RoPE and SiLU-and-mul steps: one kernel each instead of PyTorch's several (docs/benchmarks.md section 31; without Triton installed, PyTorch's ops)"))
    disable_overlap_schedule: bool | None = field(default=None, metadata=_help("run each step's scheduling after the previous step's tokens are read, instead of while the device computes it (overlap scheduling). Default: overlap on CUDA, off on the CPU (where the forward runs on the host's own cores and there is nothing to overlap); --no-disable-overlap-schedule turns it on anywhere"))
    cpu_small_gemm: bool = field(default=True, metadata=_help("on CPU, the C product kernels: float32 weights packed into panels for every batch (one more weight copy), and float16/bfloat16/int8 weights (built on first use; PyTorch fallback)"))
    cpu_amx: bool = field(default=True, metadata=_help("on CPUs with AMX (Intel's matrix units), run bfloat16 weights' products on the tiles: activations rounded to bfloat16, float32 accumulation and output (off: widened to float32 in the C kernel, exact float32 arithmetic)"))
    cpu_vnni: bool = field(default=True, metadata=_help("on CPUs with AVX512-VNNI (AMD Zen 4 and 5, Intel since Cascade Lake), run int8 and int4 weights' products on its 16-bit integer dot products: activations rounded to int16 per block of 32 inputs, exact integer sums, float32 output (off: the weights widened to float32 in the C kernel, float32 arithmetic on the stored values)"))
    cpu_bf16_dot: bool = field(default=True, metadata=_help("on CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and 5, for one), run bfloat16 weights' products on its dot-product instruction: activations rounded to bfloat16, float32 accumulation and output, as on AMX (off: widened to float32 in the C kernel, exact float32 arithmetic)"))
    cpu_prepack: bool | None = field(default=None, metadata=_help("on CPU, prepack float32 linear weights for oneDNN (one more weight copy), which then runs the batches past 256 rows. Default: only for the weights the C panels kernel does not hold (no C compiler, --no-cpu-small-gemm, a CPU without AVX), since the panels ran prefill's products faster (docs/benchmarks.md section 25); --cpu-prepack forces it"))
    cpu_decode_plan: bool = field(default=True, metadata=_help("on CPU (float32 Qwen3-style models, cpu attention backend), run a step's layers (decodes, prompt chunks, both mixed) in one C call rather than ~10 Python calls a layer, the same kernels in the same order (off: through the modules)"))
    cpu_fused_ops: bool = field(default=True, metadata=_help("on CPU (float32), C kernels for the add+RMSNorm and q/k norm+RoPE steps of each layer (built on first use; PyTorch fallback)"))
    cpu_prefault_kv: bool = field(default=False, metadata=_help("on CPU, write the whole KV pool once at start, so no step pays first-touch page faults (about 1.4 s per GiB at start; benchmarks turn it on)"))
    cpu_keep_freed_memory: bool = field(default=True, metadata=_help("on CPU (Linux, glibc), keep freed memory in the process's heap for reuse rather than unmapping large blocks, so each step's large tensors do not page-fault in again; the process keeps its peak memory"))
    num_threads: int | None = field(default=None, metadata=_help("torch CPU threads (default: torch's)"))
    # Speculative decoding (SGLang's flag names)
    speculative_algorithm: str | None = field(default=None, metadata=_help("NGRAM: each decoding request drafts the tokens that followed the last earlier occurrence of its most recent tokens (in its prompt and output) and the step verifies them all at once; greedy output is unchanged and sampled output keeps its distribution (rejection sampling). Pays on text that copies: rewrites, extraction, edits, answers from a document"))
    speculative_num_draft_tokens: int = field(default=4, metadata=_help("NGRAM: tokens drafted per request and step"))
    speculative_ngram_min_match_window_size: int = field(default=1, metadata=_help("NGRAM: the shortest suffix of the request that a draft is looked up by"))
    speculative_ngram_max_match_window_size: int = field(default=12, metadata=_help("NGRAM: the longest (the longest one found wins)"))
    speculative_max_batch_tokens: int = field(default=64, metadata=_help("NGRAM: no request drafts in a step whose decodes times (draft tokens + 1) exceed this: a batch that large is bound by compute, where drafts cost what they save"))
    # Structured output
    grammar_backend: str = field(default="auto", metadata=_help("grammar engine for json_schema / regex / ebnf / response_format: xgrammar, none (such requests are refused), auto (xgrammar when installed)"))
    constrained_json_any_whitespace: bool = field(default=False, metadata=_help("let JSON output put any whitespace between tokens (SGLang's and vLLM's default); off: compact JSON, since a model that likes whitespace can fill max_tokens with it"))
    # Parallelism
    tp_size: int = field(default=1, metadata=_help("tensor-parallel ranks: one scheduler process each, holding 1/N of every layer (gloo on CPU, NCCL on CUDA; server only)"))

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.model, str) and bool(self.model), "model must be a non-empty string")
        check(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}")
        check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        check(self.num_pages is None or self.num_pages >= 1, f"num_pages must be >= 1, got {self.num_pages}")
        check(self.kv_cache_gb is None or self.kv_cache_gb > 0, f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        check(0 < self.mem_fraction_static < 1, f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        check(self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check(self.kv_cache_dtype in DTYPE_CHOICES, f"kv_cache_dtype must be one of {DTYPE_CHOICES}, got {self.kv_cache_dtype!r}")
        check(self.cache_type in CACHE_TYPES, f"cache_type must be one of {CACHE_TYPES}, got {self.cache_type!r}")
        check(self.max_running_requests >= 1, "max_running_requests must be >= 1")
        check(self.max_prefill_tokens is None or self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1")
        check(self.context_length is None or self.context_length >= 2, "context_length must be >= 2")
        check(self.schedule_policy in SCHEDULE_POLICIES, f"schedule_policy must be one of {SCHEDULE_POLICIES}")
        check(self.schedule_aging_steps >= 1, "schedule_aging_steps must be >= 1")
        check(self.mixed_step_ratio is None or self.mixed_step_ratio == 0 or self.mixed_step_ratio > 1,
              f"mixed_step_ratio must be 0 (off) or > 1, got {self.mixed_step_ratio}")
        check(self.max_prefill_streak >= 1, "max_prefill_streak must be >= 1")
        check(self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        check(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1")
        check(self.grammar_backend in GRAMMAR_BACKENDS, f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        check(self.speculative_algorithm in (None, "NGRAM"),
              f"speculative_algorithm must be NGRAM (or unset), got {self.speculative_algorithm!r}")
        check(self.speculative_num_draft_tokens >= 1, "speculative_num_draft_tokens must be >= 1")
        check(1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size,
              "speculative n-gram window sizes must satisfy 1 <= min <= max")
        check(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")

    def prefill_chunk(self, device_type: str) -> int:
        """`max_prefill_tokens`, or its default on a device of this type."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return CPU_PREFILL_CHUNK if device_type == "cpu" else DEFAULT_PREFILL_CHUNK

    @property
    def graph_max_bs(self) -> int:
        """Largest decode batch captured in a CUDA graph (no larger batch can run)."""
        return min(self.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, self.max_running_requests)

    @property
    def verify_graph_max_bs(self) -> int:
        """Largest speculative verify batch captured in a CUDA graph (0 without speculation):
        no step drafts once its decodes times (draft tokens + 1) pass
        speculative_max_batch_tokens, so larger verify batches never occur."""
        if self.speculative_algorithm is None:
            return 0
        return min(self.graph_max_bs, self.speculative_max_batch_tokens // (self.speculative_num_draft_tokens + 1))
