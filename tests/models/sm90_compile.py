"""Compile treeflow's Triton kernels for an H100 (sm_90) without a GPU: Triton's NVIDIA backend
lowers them through MLIR and LLVM and assembles them with its own ptxas, which catches what the
CPU tests' interpreter lets through (a type a loop changes, a scalar branch, a pointer of the
wrong kind). Run as a script (Triton must not be in interpreter mode); prints one line a kernel
and exits non-zero at the first that does not compile. Used by test_triton_sm90.py.

    python tests/models/sm90_compile.py
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from treeflow.models.heads import triton_loss  # noqa: E402
from treeflow.models.moe import triton_moe  # noqa: E402

P = "*bf16"
KERNELS = [  # (kernel, {argument: type}, constexprs, num_warps): as the wrappers launch them
    (triton_loss._loss_tile_stats,
     dict(x_ptr=P, sx="i64", v0="i32", t_ptr="*i64", m_ptr="*fp32", s_ptr="*fp64",
          xs_ptr="*fp64", tgt_ptr="*fp32", W="i32"), dict(ENT=True, BW=2048), 8),
    (triton_loss._loss_tile_stats,
     dict(x_ptr="*fp32", sx="i64", v0="i32", t_ptr="*i64", m_ptr="*fp32", s_ptr="*fp64",
          xs_ptr="*fp64", tgt_ptr="*fp32", W="i32"), dict(ENT=False, BW=2048), 8),
    (triton_loss._loss_tile_grad,
     dict(x_ptr=P, sx="i64", gx_ptr=P, sg="i64", v0="i32", lse_ptr="*fp32", t_ptr="*i64",
          g_ptr="*fp32", ge_ptr="*fp32", ent_ptr="*fp32", W="i32"),
     dict(HAS_G=True, HAS_GE=True, BW=1024), 4),
    (triton_loss._loss_tile_grad,
     dict(x_ptr=P, sx="i64", gx_ptr=P, sg="i64", v0="i32", lse_ptr="*fp32", t_ptr="*i64",
          g_ptr="*fp32", ge_ptr="*fp32", ent_ptr="*fp32", W="i32"),
     dict(HAS_G=True, HAS_GE=False, BW=1024), 4),
    (triton_moe._swiglu_fwd, dict(h_ptr=P, sh="i64", out_ptr=P, so="i64", R="i32", I="i32"),
     dict(BR=4, BC=512), 4),
    (triton_moe._swiglu_bwd, dict(h_ptr=P, sh="i64", d_ptr=P, sd="i64", dh_ptr=P, R="i32",
                                  I="i32"), dict(BR=4, BC=512), 4),
    (triton_moe._combine_fwd, dict(out_ptr=P, so="i64", w_ptr=P, inv_ptr="*i64", y_ptr=P,
                                   N="i32", H="i32"), dict(K=8, ROUND=True, BR=4, BC=512), 4),
    (triton_moe._combine_bwd, dict(dy_ptr=P, sdy="i64", out_ptr=P, so="i64", w_ptr=P,
                                   inv_ptr="*i64", dout_ptr=P, dw_ptr="*fp32", N="i32",
                                   H="i32"), dict(K=8, ROUND=True, BR=4, BC=512), 4),
]


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for kernel, sig, const, warps in KERNELS:
        name = f"{kernel.fn.__name__}{sorted(const.items())}"
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature={**sig, **{
                k: "constexpr" for k in const}}, constexprs=const), target=target,
                options={"num_warps": warps})
        except Exception as e:  # the kernel and Triton's own message
            print(f"{name}: does not compile for sm_90: {type(e).__name__}: {e}")
            return 1
        print(f"{name}: {len(compiled.asm['cubin'])} bytes of sm_90 code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
