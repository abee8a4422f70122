"""Compiles the CUDA path's Triton kernels for a GPU this machine does not have.

Run as a script (`python tests/triton_sm90.py`, in a process without TRITON_INTERPRET, which
turns @triton.jit into the interpreter): the public wrappers of kernels/triton_attention.py and
kernels/triton_ops.py are called on CPU tensors with every launch recorded instead of run, and
each launch is compiled to a cubin for the targets below by Triton and the ptxas it ships.
The interpreter runs the kernels' arithmetic on the CPU but skips what only the compiler
checks (types carried through loops, the bfloat16 products it replaces with float32, layouts);
this is that check. Prints one line a kernel and configuration; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import traceback

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# Hopper (H100, H200) and Ampere (A100).
TARGETS = (GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32))
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
           torch.int64: "*i64"}

launches: list[tuple[str, JITFunction, tuple, dict]] = []
label = ""


def record(self: JITFunction, *args: object, grid: object = None, warmup: bool = False, **kwargs: object) -> None:
    launches.append((label, self, args, kwargs))


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, target: GPUTarget) -> None:
    bound = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in fn.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    triton.compile(ASTSource(fn, signature, constexprs), target=target)


def main() -> int:
    global label
    JITFunction.run = record  # type: ignore[method-assign]
    from minisgl_mp.kernels import triton_attention as attn
    from minisgl_mp.kernels import triton_ops as ops

    def i32(*xs: int) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32)

    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.float16, torch.float16), (torch.float32, torch.bfloat16)):
        for hq, hkv, d in ((16, 8, 128), (9, 3, 64)):  # Qwen3-0.6B's heads; SmolLM2-135M's
            name = f"{str(dtype)[6:]} model, {str(kv_dtype)[6:]} KV, {hq}/{hkv} heads of {d}"
            q = torch.zeros(8, hq, d, dtype=dtype)
            k = v = torch.zeros(64, hkv, d, dtype=kv_dtype)
            table = torch.zeros(4, 32, dtype=torch.int32)
            label = f"decode, {name}"
            attn.decode_attention(q, k, v, torch.empty_like(q), table, torch.arange(8), torch.zeros(8, dtype=torch.int64),
                                  i32(*range(1, 9)), d**-0.5)
            label = f"extend, {name}"
            attn.extend_attention(q, k, v, torch.empty_like(q), table, torch.zeros(2, dtype=torch.int64), i32(0, 4),
                                  i32(4, 4), i32(0, 3), 4, d**-0.5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        label = f"fused element-wise ops, {str(dtype)[6:]}"
        x = torch.zeros(4, 1024, dtype=dtype)
        ops.add_rmsnorm(x, torch.zeros_like(x), torch.ones(1024, dtype=dtype), 1e-6)
        ops.silu_mul(torch.zeros(4, 2 * 3072, dtype=dtype))
        qkv = torch.zeros(4, (16 + 2 * 8) * 128, dtype=dtype)
        cos_sin = torch.zeros(64, 128, dtype=torch.float32)
        w = torch.ones(128, dtype=dtype)
        pos = torch.zeros(4, dtype=torch.int64)
        ops.qk_norm_rope(qkv, 16, 8, 128, w, w, 1e-6, cos_sin, pos)  # Qwen3's q/k norms
        ops.qk_norm_rope(qkv, 16, 8, 128, None, None, 0.0, cos_sin, pos)  # none (Llama)
    JITFunction.run = None  # type: ignore[assignment]

    failed = 0
    for what, fn, args, kwargs in launches:
        for target in TARGETS:
            try:
                compile_launch(fn, args, kwargs, target)
                print(f"ok   sm_{target.arch} {fn.__name__}: {what}")
            except Exception:  # noqa: BLE001 - every failure is reported, then the exit code says so
                failed += 1
                print(f"FAIL sm_{target.arch} {fn.__name__}: {what}\n{traceback.format_exc()}")
    print(f"{len(launches) * len(TARGETS) - failed} compiled, {failed} failed")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
