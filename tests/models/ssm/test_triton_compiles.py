"""Every Triton kernel of the Mamba-2 tree scan and conv compiles for an H100 (sm_90), on CPU.

The CPU tests run the kernels in Triton's interpreter (test_ssm_triton.py), which executes
them as Python: it cannot show what only the compiler rejects. One such bug shipped there: a
`return` inside a constexpr `if` ends the interpreter's function, while compiled Triton also
generates the statements after it, so `scan_precision="bf16"` built `tl.dot(...,
input_precision="bf16")`, which does not compile; every bf16 kernel failed on a GPU and the
interpreter tests passed. Here each kernel is compiled with Triton's own compiler for
`GPUTarget("cuda", 90, 32)` (Triton IR to PTX to a cubin with its bundled ptxas; no GPU is
needed), in every product precision and in the dtypes the launches use, at the smallest tiles
(16: the tile size does not change which statements are generated). It runs in a subprocess
without TRITON_INTERPRET, which turns `triton.jit` into the interpreter at import.

Plant: `mm`'s bf16 branch as an early return (the shipped form): the bf16 case fails.
Not covered: wrong numbers at run time (tests/gpu/test_gpu_scan.py on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
# pointer arguments that hold int64 ids or maps; every other pointer is a float tensor
INT64 = {"src_ptr", "dst_ptr", "a_map", "seg_ptr", "rows_ptr", "kptr_ptr", "kids_ptr",
         "rowptr_ptr", "slots_ptr", "idx_ptr", "ptr_ptr", "tap_ptr", "map_ptr"}


def _cases():
    """(kernel, constexprs, pointer dtypes that are not float32) for each compile."""
    import triton.language as tl

    from treeflow.models.ssm import triton_bwd as B
    from treeflow.models.ssm import triton_conv as CV
    from treeflow.models.ssm import triton_scan as S

    out = []
    for prec in ("ieee", "tf32x3", "bf16"):
        mk = dict(PREC=prec, INTERPRET=False, BL=16, BP=16, BN=16)
        out += [(S._chunk_outer, dict(FROM_END=True, **mk), {}),
                (S._chunk_outer, dict(FROM_END=False, **mk), {}),
                (S._chunk_scan_fwd, mk, {}), (B.dx_bwd, mk, {}), (B.dc_bwd, mk, {}),
                (B.db_bwd, mk, {})]
    bf16_in = {"x_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "dt_ptr": "*bf16"}
    out += [(S._chunk_scan_fwd, dict(PREC="tf32x3", INTERPRET=False, BL=16, BP=16, BN=16),
             {**bf16_in, "table_ptr": "*bf16"}),
            (S._state_pass_fwd, dict(BP=16, BN=16), {}),
            (S._state_pass_fwd, dict(BP=16, BN=16), {"table_ptr": "*bf16", "prev_ptr": "*bf16"}),
            (B.state_pass_bwd, dict(BP=16, BN=16), {}),
            (S._acs_fwd, dict(BC=128), {}), (B.acs_bwd, dict(BC=128), {}),
            (B.token_x_bwd, dict(BT=32, BP=64), {"dx_ptr": "*bf16", "ddt_ptr": "*bf16",
                                                  "x_ptr": "*bf16"}),
            (B.token_sum, dict(BT=32, BW=256), {"out_ptr": "*bf16"})]
    for acc, io, grad in ((tl.float32, "*bf16", "*fp32"), (tl.float64, "*fp64", "*fp64")):
        out += [(CV._conv_fwd, dict(K=4, HAS_BIAS=True, BT=32, BC=128, ACC=acc),
                 {"x_ptr": io, "y_ptr": io}),
                (CV._conv_bwd_du, dict(K=4, KP=4, HAS_BIAS=True, BT=32, BC=128, ACC=acc),
                 {"x_ptr": io, "dy_ptr": io, "du_ptr": grad, "dw_ptr": grad, "db_ptr": grad}),
                (CV._conv_bwd_dx, dict(K=4, BC=512, ACC=acc), {"dx_ptr": io, "du_ptr": grad})]
    return out


def compile_all() -> None:
    """Compile every case for sm_90; print one line per failure, exit 1 if any failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, failed, n = GPUTarget("cuda", 90, 32), [], 0
    for fn, const, dtypes in _cases():
        sig = {a: "constexpr" if a in const else
               ("*i64" if a in INT64 else dtypes.get(a, "*fp32"))
               if a.endswith("_ptr") or a == "a_map" else "i32" for a in fn.arg_names}
        n += 1
        try:
            triton.compile(ASTSource(fn, sig, const), target=target,
                           options=dict(num_warps=4, num_stages=2))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the test fails
            why = str(e.__cause__ or e).strip().splitlines()  # the compiler's own reason
            failed.append(f"{fn.__name__} {const}: {type(e).__name__}: "
                          f"{why[-1] if why else ''}")
    print(f"compiled {n - len(failed)} of {n}")
    for line in failed:
        print("FAILED", line)
    sys.exit(1 if failed else 0)


def test_every_scan_and_conv_kernel_compiles_for_sm90(tmp_path):
    import triton

    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    if not os.path.exists(os.path.join(nvidia, "bin", "ptxas")):
        pytest.skip("this triton has no CUDA backend with its ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))  # compile, never read a cache
    proc = subprocess.run([sys.executable, "-c", "from tests.models.ssm.test_triton_compiles "
                           "import compile_all; compile_all()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled" in proc.stdout, proc.stdout
