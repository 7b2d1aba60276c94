"""Every Triton kernel of the Mamba-2 tree scan and conv compiles for an H100 (sm_90), on CPU.

The CPU tests run the kernels in Triton's interpreter (test_ssm_triton.py), which executes
them as Python: it cannot show what only the compiler rejects. One such bug shipped there: a
`return` inside a constexpr `if` ends the interpreter's function, while compiled Triton also
generates the statements after it, so `scan_precision="bf16"` built `tl.dot(...,
input_precision="bf16")`, which does not compile; every bf16 kernel failed on a GPU and the
interpreter tests passed. Here every launched kernel of the three modules (found by
inspection, so a new kernel is covered) is compiled with Triton's own compiler for
`GPUTarget("cuda", 90, 32)` (Triton IR to PTX to a cubin with its bundled ptxas; no GPU is
needed) in every combination of its constexprs (each product precision, both scan
directions, float32 and float64 conv accumulation) with float32 and with bf16 inputs, at the
smallest tiles (16: the tile size does not change which statements are generated); 57
compiles, ~20 s. It runs in a subprocess without TRITON_INTERPRET, which turns `triton.jit`
into the interpreter at import.

Plant: `mm`'s bf16 branch as an early return (the shipped form): 12 bf16 compiles fail, each
named with the compiler's reason.
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


# constexpr name -> the values compiled (each kernel: every combination of its own)
# (and PREC: every product precision of triton_scan.BLOCKS)
CONSTEXPRS = {"INTERPRET": (False,), "FROM_END": (True, False),
              "BL": (16,), "BP": (16,), "BN": (16,), "BC": (128,), "BT": (32,), "BW": (256,),
              "K": (4,), "KP": (4,), "HAS_BIAS": (True,), "ACC": ("float32", "float64")}
# pointers that are bf16 where the model runs in bf16 (the launches' inputs, outputs and state
# tables; accumulators stay float32); with ACC=float64 every float pointer is float64
BF16 = {"x_ptr", "b_ptr", "c_ptr", "dt_ptr", "y_ptr", "dy_ptr", "dx_ptr", "ddt_ptr", "out_ptr",
        "table_ptr", "prev_ptr", "init_ptr"}


def _kernels():
    """The launched kernels of the three modules: their @triton.jit functions with no return
    (helpers return values; the conv's store helper writes through a pointer it is given)."""
    import ast

    from treeflow.models.ssm import triton_bwd, triton_conv, triton_scan

    out = []
    for mod in (triton_scan, triton_bwd, triton_conv):
        for name, fn in vars(mod).items():
            src = getattr(fn, "src", None)
            if src is None or getattr(fn, "__module__", None) != mod.__name__ or \
                    name.lstrip("_") == "store" or \
                    any(isinstance(node, ast.Return) for node in ast.walk(ast.parse(src))):
                continue
            out.append(fn)
    assert len(out) >= 10, [f.__name__ for f in out]  # a discovery gone wrong fails here
    return out


def _cases():
    """(kernel, constexprs, signature) for each compile: every kernel in every combination
    of its constexprs' values, float32 pointers, and again with bf16 ones."""
    import itertools

    import triton.language as tl

    from treeflow.models.ssm.triton_scan import BLOCKS

    choices, out = {**CONSTEXPRS, "PREC": tuple(BLOCKS)}, []
    for fn in _kernels():
        names = [a for a in fn.arg_names if a in choices]
        for values in itertools.product(*(choices[a] for a in names)):
            const = dict(zip(names, values))
            f64 = const.get("ACC") == "float64"
            if "ACC" in const:
                const["ACC"] = getattr(tl, const["ACC"])
            for bf16 in ((False,) if f64 else (False, True)):
                sig = {}
                for a in fn.arg_names:
                    if a in const:
                        sig[a] = "constexpr"
                    elif not (a.endswith("_ptr") or a == "a_map"):
                        sig[a] = "i32"
                    elif a in INT64:
                        sig[a] = "*i64"
                    else:
                        sig[a] = "*fp64" if f64 else "*bf16" if bf16 and a in BF16 else "*fp32"
                out.append((fn, const, sig))
    return out


def compile_all() -> None:
    """Compile every case for sm_90; print one line per failure, exit 1 if any failed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, failed, n = GPUTarget("cuda", 90, 32), [], 0
    for fn, const, sig in _cases():
        n += 1
        try:
            triton.compile(ASTSource(fn, sig, const), target=target,
                           options=dict(num_warps=4, num_stages=2))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the test fails
            why = str(e.__cause__ or e).strip().splitlines()  # the compiler's own reason
            io = next((t[1:] for t in ("*bf16", "*fp64") if t in sig.values()), "fp32")
            failed.append(f"{fn.__name__} {const} {io} inputs: {type(e).__name__}: "
                          f"{why[-1] if why else ''}")
    for line in failed:
        print("FAILED", line)
    print(f"compiled {n - len(failed)} of {n}")
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
