"""Every Triton kernel of treeflow compiles for an H100 (sm_90), on CPU: the Mamba-2 tree scan, conv and
norms, the MoE experts' SwiGLU and combine (models/moe/triton_moe.py) and the fused loss's
tiles (models/heads/triton_loss.py).

The CPU tests run the kernels in Triton's interpreter (test_ssm_triton.py), which executes
them as Python: it cannot show what only the compiler rejects. One such bug shipped there: a
`return` inside a constexpr `if` ends the interpreter's function, while compiled Triton also
generates the statements after it, so `scan_precision="bf16"` built `tl.dot(...,
input_precision="bf16")`, which does not compile; every bf16 kernel failed on a GPU and the
interpreter tests passed. Here every launched kernel of the four modules (scan, backward, conv, the hybrids' norms) (found by
inspection, so a new kernel is covered) is compiled with Triton's own compiler for
`GPUTarget("cuda", 90, 32)` (Triton IR to PTX to a cubin with its bundled ptxas; no GPU is
needed) in every combination of its constexprs (each product precision, both scan
directions, float32 and float64 conv accumulation) with float32 and with bf16 inputs, at the
smallest tiles (16: the tile size does not change which statements are generated; the norms'
group tile 512 and backward row block 64, both gate and rounding settings, forward and
backward): 81 cases,
each compiled twice. Once unaligned, and once aligned: every pointer and int argument marked
16-divisible, the `tt.divisibility` attrs Triton's launcher gives a real launch (torch's
allocations, sizes like 4096), which change the layouts the compiler picks. Only the aligned
compile showed the second shipped bug: under Triton 3.6 (torch 2.11's) and 3.7, the CSR slot
loops of `token_x_bwd` and `token_sum` held a [BT] slot vector beside a [BT, W] tile, and
the two got different layouts ("'tt.load' op failed to verify that mask type matches ptr
type", then TritonGPURemoveLayoutConversions failed); unaligned they compiled. 162 compiles,
split over up to 4 processes (~35 s of CPU in all), the first of which also reads the kernels'
specialization for the bin-size test. They run without TRITON_INTERPRET, which
turns `triton.jit` into the interpreter at import, and with the test's PYTHONPATH after the
repo: a Triton installed aside (`pip install --target`) put first on it is the one compiled
with.

Plants: `mm`'s bf16 branch as an early return (the shipped form): 24 bf16 compiles (12
cases, each both ways) fail, each named with the compiler's reason; the loss tile's float32
running sum made float64 inside its loop (a loop-carried type change the interpreter runs); the CSR loops' slot
vectors 1-D again, under Triton 3.6.0 or 3.7.1: the 4 aligned compiles of `token_x_bwd` and
`token_sum` fail, the unaligned pass.
Not covered: wrong numbers at run time (tests/gpu/test_gpu_scan.py on a GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
# pointer arguments that hold int64 ids or maps; every other pointer is a float tensor
INT64 = {"src_ptr", "dst_ptr", "a_map", "seg_ptr", "rows_ptr", "kptr_ptr", "kids_ptr",
         "rowptr_ptr", "slots_ptr", "idx_ptr", "ptr_ptr", "tap_ptr", "map_ptr",
         "inv_ptr", "t_ptr"}  # the MoE combine's inverse permutation, the loss's target ids
# (kernel, pointer) that are float64 whatever the model's dtype: the fused loss's running sums
# (the scan's s_ptr is a float32 state)
F64 = {("_loss_tile_stats", "s_ptr"), ("_loss_tile_stats", "xs_ptr")}


# constexpr name -> the values compiled (each kernel: every combination of its own)
# (and PREC: every product precision of triton_scan.BLOCKS)
CONSTEXPRS = {"INTERPRET": (False,), "FROM_END": (True, False),
              "BL": (16,), "BP": (16,), "BN": (16,), "BC": (128,), "BT": (32,), "BW": (256,),
              "K": (4,), "KP": (4,), "HAS_BIAS": (True,), "ACC": ("float32", "float64"),
              "GATED": (True, False), "ROUND": (True, False), "BS": (512,),
              "KEEP": (True, False), "BR": (64,),
              "ENT": (True, False), "HAS_G": (True, False), "HAS_GE": (True, False)}
# pointers that are bf16 where the model runs in bf16 (the launches' inputs, outputs and state
# tables; accumulators stay float32); with ACC=float64 every float pointer is float64
BF16 = {"x_ptr", "b_ptr", "c_ptr", "dt_ptr", "y_ptr", "dy_ptr", "dx_ptr", "ddt_ptr", "out_ptr",
        "table_ptr", "prev_ptr", "init_ptr", "z_ptr", "w_ptr", "dz_ptr",
        "h_ptr", "d_ptr", "dh_ptr", "dout_ptr", "gx_ptr"}  # the MoE and loss kernels' rows
FLOAT_ARGS = {"eps"}  # float scalars (every other non-pointer argument is an int)


def _kernels():
    """The launched kernels of the three modules: their @triton.jit functions with no return
    (helpers return values; the conv's store helper writes through a pointer it is given)."""
    import ast

    from treeflow.models.heads import triton_loss
    from treeflow.models.moe import triton_moe
    from treeflow.models.ssm import triton_bwd, triton_conv, triton_norm, triton_scan

    out = []
    for mod in (triton_scan, triton_bwd, triton_conv, triton_norm, triton_moe, triton_loss):
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
    """(kernel, constexprs, signature) for each kernel in every combination of its constexprs'
    values, float32 pointers, and again with bf16 ones."""
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
                    elif a in FLOAT_ARGS:
                        sig[a] = "fp32"
                    elif not (a.endswith("_ptr") or a == "a_map"):
                        sig[a] = "i32"
                    elif a in INT64:
                        sig[a] = "*i64"
                    elif (fn.__name__, a) in F64:
                        sig[a] = "*fp64"
                    else:
                        sig[a] = "*fp64" if f64 else "*bf16" if bf16 and a in BF16 else "*fp32"
                out.append((fn, const, sig))
    return out


def _aligned(fn, sig, backend) -> dict:
    """The attrs a launch gives when every pointer and int argument is 16-divisible (torch's
    allocations, sizes like 64 or 4096): what `JITFunction.run` passes, the backend's parse of
    the specialization "D" for each argument it may specialize."""
    return {(i,): backend.parse_attr("D") for i, (a, param) in
            enumerate(zip(fn.arg_names, fn.params))
            if sig[a] != "constexpr" and not param.do_not_specialize
            and not param.do_not_specialize_on_alignment}


def compile_all(part: int = 0, parts: int = 1, compile: bool = True) -> None:
    """Part 0 first prints each launched kernel's bin-size parameters' `do_not_specialize`
    (SPECIALIZED lines). Then (with `compile`) compile every case for sm_90, unaligned and
    aligned (or every parts-th from part on); print one line per failure and the count, exit 1
    if any failed."""
    if part == 0:
        for fn in _kernels():
            for a in ("N", "R"):
                if a in fn.arg_names:
                    p = fn.params[fn.arg_names.index(a)]
                    print("SPECIALIZED", fn.__name__, p.do_not_specialize, flush=True)
    if not compile:
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", 90, 32)
    backend, failed, n = make_backend(target), [], 0
    todo = [(case, aligned) for case in _cases() for aligned in (False, True)]
    for (fn, const, sig), aligned in todo[part::parts]:
        n += 1
        try:
            attrs = _aligned(fn, sig, backend) if aligned else None
            triton.compile(ASTSource(fn, sig, const, attrs), target=target,
                           options=dict(num_warps=4, num_stages=2))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the test fails
            why = str(e.__cause__ or e).strip().splitlines()  # the compiler's own reason
            io = next((t[1:] for t in ("*bf16", "*fp64") if t in sig.values()), "fp32")
            failed.append(f"{fn.__name__} {const} {io} inputs{', aligned' if aligned else ''}: "
                          f"{type(e).__name__}: {why[-1] if why else ''}")
    for line in failed:
        print("FAILED", line)
    print(f"compiled {n - len(failed)} of {n}")
    sys.exit(1 if failed else 0)


def _has_ptxas() -> bool:
    import triton

    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia")
    return os.path.exists(os.path.join(nvidia, "bin", "ptxas"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiling processes, run once for both tests below (one start of torch, triton and
    the kernels' modules fewer): [(returncode, stdout, stderr)], the first one's stdout with the
    SPECIALIZED lines. Without a ptxas, one process that only reads the kernels."""
    tmp_path = tmp_path_factory.mktemp("triton_compiles")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))  # compile, never read a cache
    compile = _has_ptxas()
    # compiles are independent: split them over processes
    parts = min(4, os.cpu_count() or 1) if compile else 1
    procs, logs = [], [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(parts)]
    for i, (out, err) in enumerate(logs):
        with open(out, "w") as fo, open(err, "w") as fe:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", "from tests.models.ssm.test_triton_compiles import "
                 f"compile_all; compile_all({i}, {parts}, {compile})"], cwd=ROOT, env=env,
                stdout=fo, stderr=fe))
    for proc in procs:
        proc.wait(timeout=600)
    return [(proc.returncode, out.read_text(), err.read_text())
            for proc, (out, err) in zip(procs, logs)]


def test_every_scan_and_conv_kernel_compiles_for_sm90(compiled):
    import triton

    if not _has_ptxas():
        pytest.skip("this triton has no CUDA backend with its ptxas")
    ok = n = 0
    failed, why = [], []
    for returncode, text, err in compiled:
        counts = re.findall(r"^compiled (\d+) of (\d+)$", text, re.M)
        assert counts, text + err[-3000:]  # a process that died before its count
        ok, n = ok + int(counts[-1][0]), n + int(counts[-1][1])
        failed += [line for line in text.splitlines() if line.startswith("FAILED")]
        if returncode:  # the compiler's diagnostics (its IR dumps left out)
            lines = err.splitlines()
            why += [line for line in lines if "error:" in line] or lines[-20:]
    # the count last: a long report cut from the front keeps it
    count = f"compiled {ok} of {n} (triton {triton.__version__})"
    assert not failed and all(returncode == 0 for returncode, _, _ in compiled), \
        "\n".join([*dict.fromkeys(why), *failed, count])
    assert n > 100, n  # every case ran (162 today: 81 unaligned, 81 aligned)


def test_the_bin_size_is_not_specialized(compiled):
    """Every launched kernel taking the bin's token count N (or its routed row count R) leaves
    it unspecialized, so one compile serves bins of every size: a warm-up on the budget's 16-divisible size and a
    run's first odd-sized bin would otherwise compile each kernel twice on a GPU (inside the
    first windows, where a user waits). Read in the first compiling process, before its
    compiles, without TRITON_INTERPRET (the interpreter's functions carry no launcher
    parameters). Plant: drop it from one kernel."""
    _, text, err = compiled[0]
    lines = [line.split()[1:] for line in text.splitlines() if line.startswith("SPECIALIZED ")]
    assert lines, err[-3000:]  # a process that died before reading the kernels
    seen = dict(lines)
    assert len(seen) >= 14, seen  # the scan's, the backward's, the conv's, the MoE's
    assert all(v == "True" for v in seen.values()), seen
