"""Tests for kernel.py, the Triton kernel: on the CPU under TRITON_INTERPRET=1 (set by conftest.py),
and compiled ahead of time for real GPUs with Triton's bundled ptxas (no GPU needed).
Run: python -m pytest -q tests/test_kernel.py   (add --slow for the compile table of every target)"""
import ast
import contextlib
import importlib.util
import io
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import attention as A
import tiled
from test_attention import (assert_a_bad_value_reaches_only_its_queries, assert_same, attention_kinds, out_and_grads,
                            edge_pairs, qkv, random_perm)

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernel tests need it")
import kernel  # noqa: E402  (after the skip)

# the interpreter also computes padding rows past T, which may see no key (0 / 0); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
KDEV = "cuda" if torch.cuda.is_available() else "cpu"  # conftest.py turns on the interpreter without a GPU
# small blocks, so that T <= 130 spans several blocks: edge and interior blocks are both exercised
SMALL = kernel.Tiling(32, 16, 32, 16, num_warps=4, num_stages=2, precision=None, shared_kb=0)


@pytest.fixture
def small_blocks(monkeypatch):
    choose = kernel.choose_tiling
    monkeypatch.setattr(kernel, "choose_tiling", lambda *a: SMALL._replace(precision=choose(*a).precision))


def kernel_case(B, H, T, D, dtype, pos_kind):
    q, k, v = qkv(B, H, T, D, dtype=dtype, device=KDEV)
    pos = {"none": None, "perm": random_perm((), T, device=KDEV), "bht": random_perm((B, H), T, device=KDEV)}
    return q, k, v, pos[pos_kind]


# Every T meets every window once; the pos kind rotates so it meets every T and every window too.
POS_KINDS = ("none", "perm", "bht")
KERNEL_CASES = [(T, w, POS_KINDS[(i + j) % 3]) for i, T in enumerate((1, 17, 100, 130))
                for j, w in enumerate((1, 16, 33, 1000))]


@pytest.mark.parametrize("T, window, pos_kind", KERNEL_CASES)
def test_triton_swa_matches_reference_fp32(small_blocks, T, window, pos_kind):
    q, k, v, pos = kernel_case(2 if pos_kind == "bht" else 1, 2, T, 16, torch.float32, pos_kind)
    assert_same(lambda *x: kernel.triton_swa(*x, window, pos), q, k, v, lambda *x: A.swa_reference(*x, window, pos))


@pytest.fixture
def bf16_dot(monkeypatch):
    """triton's interpreter keeps bf16 as raw uint16 and its tl.dot multiplies the bit
    patterns (triton-lang/triton#11584, unsupported upstream). Upcast bf16 dot operands
    to fp32 first, as the GPU's tensor cores effectively do. No-op on a GPU."""
    if KDEV == "cuda":
        return
    import triton.language as tl
    from triton.runtime import interpreter
    builder, dot = interpreter.interpreter_builder, interpreter.interpreter_builder.create_dot

    def create_dot(a, b, *rest):
        a, b = (builder.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(a, b, *rest)
    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.mark.parametrize("T, window, pos_kind, dtype", [
    (1, 1, "perm", torch.bfloat16), (17, 16, "none", torch.bfloat16), (100, 1000, "perm", torch.bfloat16),
    (130, 33, "bht", torch.bfloat16), (100, 33, "perm", torch.float16)])
def test_triton_swa_half_precision(small_blocks, bf16_dot, T, window, pos_kind, dtype):
    """Half-precision inputs against the fp32 reference on the same (rounded) values."""
    q, k, v, pos = kernel_case(2 if pos_kind == "bht" else 1, 2, T, 16, dtype, pos_kind)
    assert_same(lambda *x: kernel.triton_swa(*x, window, pos), q, k, v, lambda *x: A.swa_reference(*x, window, pos))


def test_triton_swa_head_dim_64(small_blocks):
    q, k, v, pos = kernel_case(1, 1, 100, 64, torch.float32, "perm")
    assert_same(lambda *x: kernel.triton_swa(*x, 33, pos), q, k, v, lambda *x: A.swa_reference(*x, 33, pos))


def test_triton_swa_default_config():
    """The configuration choose_tiling gives (here the sm_80 one), not only the small test blocks."""
    q, k, v, pos = kernel_case(1, 1, 300, 64, torch.float32, "perm")
    assert_same(lambda *x: kernel.triton_swa(*x, 100, pos), q, k, v, lambda *x: A.swa_reference(*x, 100, pos))


@pytest.mark.parametrize("perm_shape", [(), (2, 1)])
def test_stochastic_attention_through_triton(small_blocks, monkeypatch, perm_shape):
    """SA end to end: gather by perm, triton_swa(pos=perm), scatter back == the dense SA reference."""
    monkeypatch.setattr(A, "IMPL", "triton")
    q, k, v = qkv(2, 2, 100, 16, device=KDEV)
    perm = random_perm(perm_shape, 100, device=KDEV)
    assert_same(lambda *x: A.stochastic_attention(*x, 16, perm), q, k, v, lambda *x: A.sa_reference(*x, 16, perm))


@pytest.mark.parametrize("T, window, r_shape, dtype", [(1, 3, (), torch.float32), (100, 16, (), torch.float32),
                                                   (130, 40, (2, 2), torch.float32), (100, 1000, (), torch.float32),
                                                   (100, 16, (2, 1), torch.bfloat16)])
def test_value_sa_through_triton(small_blocks, bf16_dot, monkeypatch, T, window, r_shape, dtype):
    """SA's value rule end to end: sorted by r, the kernel's per-block key spans (from the host)
    and its |val_i - val_j| < width mask == the dense reference, forward and backward."""
    monkeypatch.setattr(A, "IMPL", "triton")
    q, k, v = qkv(2, 2, T, 16, dtype=dtype, device=KDEV)
    r = torch.rand(*r_shape, T, generator=torch.Generator().manual_seed(T)).to(KDEV)
    assert_same(lambda *x: A.stochastic_value_attention(*x, window / T, r), q, k, v,
                lambda *x: A.sa_value_reference(*x, window / T, r))


@pytest.mark.parametrize("r, width, problem", [(torch.rand(8).sort().values.double(), 0.1, "r must be fp32"),
                                                 (torch.arange(8.0).flip(0) / 8, 0.1, "ascending"),
                                                 (torch.rand(8).sort().values, 0.0, "width > 0")])
def test_triton_swa_rejects_bad_r(r, width, problem):
    q = torch.zeros(1, 2, 8, 16, device=KDEV)
    with pytest.raises(ValueError, match=problem):
        kernel.triton_swa(q, q, q, width, torch.arange(8, device=KDEV), r.to(KDEV))


@pytest.mark.parametrize("D, window, pos, problem", [
    (24, 4, None, "head dims"), (16, 4, torch.arange(9), "pos"),
    (16, 4, torch.arange(8).int(), "pos"), (16, 4, torch.arange(8).view(4, 1, 1, 2), "pos")])
def test_triton_swa_rejects_bad_input(D, window, pos, problem):
    q = torch.zeros(1, 2, 8, D, device=KDEV)
    with pytest.raises(ValueError, match=problem):
        kernel.triton_swa(q, q, q, window, None if pos is None else pos.to(KDEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_swa_finite_at_huge_scores(small_blocks, bf16_dot, dtype):
    """q, k scaled by 1e4 (scores ~1e9): the kernel stays finite wherever SDPA is, forward and
    backward, and its forward still equals SDPA's. Masked scores were once -1e6, so they beat real
    scores below -1e6 (wrong output), and the backward's recomputed probabilities could exceed 1
    by 2^64 (fp16 gradients overflowed)."""
    T, window = 100, 33
    q, k, v = qkv(1, 2, T, 16, dtype=dtype, device=KDEV)
    q, k = (t.detach().mul(1e4).requires_grad_() for t in (q, k))
    i = torch.arange(T, device=KDEV)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    got = [t.float() for t in assert_finite_like_sdpa(lambda *x: kernel.triton_swa(*x, window), q, k, v, mask)]
    want = [t.float() for t in assert_finite_like_sdpa(lambda *x: F.scaled_dot_product_attention(*x, attn_mask=mask),
                                                       q, k, v, mask)]
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=1e-2)


def assert_finite_like_sdpa(fn, q, k, v, mask):
    """fn's output and gradients, asserting each is finite wherever SDPA's (same dtype) is."""
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = [sdpa, *torch.autograd.grad(sdpa, (q, k, v), do)]
    out = fn(q, k, v)
    got = [out, *torch.autograd.grad(out, (q, k, v), do)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        bad = w.isfinite() & ~g.isfinite()
        assert not bad.any(), f"{name}: {bad.sum()} non-finite entries where SDPA is finite"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["swa", "sa", "sa-bht", "sa-value"])
def test_kernel_under_autocast(small_blocks, bf16_dot, monkeypatch, kind, dtype):
    """fp32 inputs under torch.autocast through the kernel: SDPA's output dtype, forward and backward
    equal to the reference under the same autocast."""
    monkeypatch.setattr(A, "IMPL", "triton")
    fast, ref = attention_kinds(100, B=2, H=2)[kind]
    q, k, v = qkv(2, 2, 100, 16, device=KDEV)
    with torch.autocast(KDEV, dtype=dtype):
        got, want = out_and_grads(fast, q, k, v), out_and_grads(ref, q, k, v)
    assert got[0].dtype == dtype
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=6e-2, rtol=5e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["swa", "sa", "sa-value"])
def test_kernel_nan_key_reaches_only_the_queries_that_see_it(small_blocks, monkeypatch, kind):
    monkeypatch.setattr(A, "IMPL", "triton")
    fast, ref = attention_kinds(100, window=4, B=1, H=2)[kind]
    q, k, v = (t.detach() for t in qkv(1, 2, 100, 16, device=KDEV))
    k[:, :, 70] = float("nan")
    want = ref(q, k, v).isnan().any(-1)
    assert want.any() and not want[..., :70].any()
    assert torch.equal(fast(q, k, v).isnan().any(-1), want)


@pytest.mark.parametrize("kind", ["swa", "sa", "sa-value"])
def test_kernel_bad_value_reaches_only_the_queries_that_see_it(small_blocks, monkeypatch, kind):
    monkeypatch.setattr(A, "IMPL", "triton")
    assert_a_bad_value_reaches_only_its_queries(*attention_kinds(100, window=4, B=1, H=2)[kind], 100, KDEV)


# -----------------------------------------------------------------------------
# The fallback: where the kernel cannot compile or run on a GPU, IMPL="auto" warns and takes
# the torch path; IMPL="triton" raises. A bug in the kernel raises under both.

def oom(*args):
    raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")


@pytest.mark.parametrize("cause, match", [("shared memory", "the GPU has 16 KB"),
                                          ("out of resources", "out of resource: shared memory")])
def test_auto_falls_back_to_torch(monkeypatch, cause, match):
    if cause == "shared memory":   # a device with 16 KB: no configuration fits
        monkeypatch.setattr(kernel, "INTERPRETER", kernel.Target("cuda", 80, 16 * 1024))
    else:                          # as a compile for a GPU may fail
        monkeypatch.setattr(kernel, "choose_tiling", oom)
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})  # no self-check passed here before
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    perm = random_perm((), 50, device=KDEV)
    monkeypatch.setattr(A, "IMPL", "triton")
    with pytest.raises(Exception, match=match):
        A.stochastic_attention(q, k, v, 8, perm)
    monkeypatch.setattr(A, "IMPL", "auto")
    monkeypatch.setattr(A, "_impl", lambda q: "triton")   # as "auto" decides for a CUDA tensor
    with pytest.warns(UserWarning, match=f"torch path instead: .*{match}"):
        assert_same(lambda *x: A.stochastic_attention(*x, 8, perm), q, k, v, lambda *x: A.sa_reference(*x, 8, perm))
    r = torch.rand(50, device=KDEV)
    with pytest.warns(UserWarning, match=f"torch path instead: .*{match}"):
        assert_same(lambda *x: A.stochastic_value_attention(*x, 0.2, r), q, k, v,
                    lambda *x: A.sa_value_reference(*x, 0.2, r))
    line = A.impl_line(KDEV, torch.float32, 16, ["sa+swa"])
    assert re.fullmatch(f"attention: the torch path for swa, sa rank on the CPU interpreter float32: .*{match}.*",
                        line), line


def test_a_kernel_bug_raises_under_auto(monkeypatch):
    """A kernel that fails for a reason other than the GPU's limits (here: blocks of 48 rows, no power
    of 2) must raise, not hide behind the torch path."""
    monkeypatch.setattr(kernel, "choose_tiling", lambda *a: SMALL._replace(tile_m=48))
    monkeypatch.setattr(A, "_impl", lambda q: "triton")
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    with pytest.raises(Exception, match="power of 2"):
        A.sliding_window_attention(q, k, v, 8)


@pytest.mark.parametrize("error", [ValueError, kernel.Unsupported])
def test_only_unsupported_falls_back_under_auto(monkeypatch, error):
    """Under "auto", the kernel declining a GPU, dtype or shape (Unsupported) takes the torch path with a warning;
    a plain ValueError raised inside the kernel is a bug, and raises."""
    def launch(*args):
        raise error("raised inside the kernel")
    monkeypatch.setattr(kernel, "_launch_args", launch)
    monkeypatch.setattr(kernel, "SELF_CHECK", False)
    monkeypatch.setattr(A, "_impl", lambda q: "triton")   # as "auto" decides for a CUDA tensor
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    if error is ValueError:
        with pytest.raises(ValueError, match="raised inside the kernel"):
            A.sliding_window_attention(q, k, v, 8)
    else:
        with pytest.warns(UserWarning, match="torch path instead: Unsupported: raised inside the kernel"):
            assert_same(lambda *x: A.sliding_window_attention(*x, 8), q, k, v, lambda *x: A.swa_reference(*x, 8))


def test_kernel_imports_nothing_from_the_repo():
    """kernel.py stands alone (python kernel.py --check too): no import of any of the repo's modules."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo_modules = {name[:-3] for folder in (root, os.path.join(root, "results"), os.path.join(root, "tests"))
            for name in os.listdir(folder) if name.endswith(".py")} | set(os.listdir(root))
    with open(os.path.join(root, "kernel.py")) as f:
        tree = ast.parse(f.read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {node.args[0].value.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", None) == "__import__"}
    assert {"torch", "triton", "os", "numpy"} <= imported and not imported & repo_modules, imported


def test_kernel_copies_equal_tiled():
    """kernel.py keeps its own copies of the band's edges and the value rule's key spans (it imports nothing from
    the repo): the same as tiled.py's, edge cases included."""
    for window, T, two_sided in itertools.product((1, 5, 100, 300), (1, 7, 100), (False, True)):
        assert kernel.band_edges(float(window), T, two_sided) == tiled.band_edges(float(window), T, two_sided)
    g = torch.Generator().manual_seed(0)
    for R, T, block, width, margin in ((1, 1, 16, 0.1, 0.0), (3, 100, 16, 0.1, 1e-6), (2, 257, 64, 0.02, 0.0),
                                       (1, 50, 32, 2.0, 1e-6)):
        val = torch.rand(R, T, generator=g).sort(-1).values
        spans = [module.value_spans(val, width, margin, block) for module in (kernel, tiled)]
        assert all(torch.equal(got, want) for got, want in zip(*spans))


class FakeCudaTensor:
    is_cuda, shape, dtype = True, (1, 2, 8, 64), torch.bfloat16


def test_choosing_the_kernel_adds_no_graph_break(monkeypatch):
    """torch 2.11's Dynamo skips importlib.util.find_spec (2.13's folds it): on an H200, a graph break in every
    attention call, and GPT.forward left eager. Played here by a find_spec that Dynamo may not trace: what chooses the
    engine is a constant to torch.compile (_triton_supported, which "auto" asks for a CUDA tensor; "triton" under the
    interpreter)."""
    find_spec = torch.compiler.disable(importlib.util.find_spec)
    monkeypatch.setattr(A, "importlib", types.SimpleNamespace(util=types.SimpleNamespace(find_spec=find_spec)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning
        torch.compile(lambda x: x + A._triton_supported(), fullgraph=True, backend="eager")(torch.ones(2))
    monkeypatch.setattr(A, "IMPL", "triton")
    swa = torch.compile(lambda q, k, v: A.sliding_window_attention(q, k, v, 4), fullgraph=True, backend="eager")
    assert_same(swa, *qkv(1, 2, 20, 16, device=KDEV), lambda *x: A.swa_reference(*x, 4))


@pytest.mark.parametrize("version, supported", [("3.2.0", True), ("3.6.0", True), ("3.9.1", True), ("3.1.0", False),
                                                ("2.3.1", False), ("3.10.0", False), ("4.0.0", False)])
def test_auto_uses_the_kernel_only_with_a_tested_triton(monkeypatch, version, supported):
    """attention.IMPL = "auto" on a CUDA tensor: the kernel with a Triton in attention.TRITON_VERSIONS; otherwise
    the torch path and one warning (not one per call)."""
    monkeypatch.setattr(triton, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own
        assert [A._impl(FakeCudaTensor()) for _ in range(2)] == ["triton" if supported else "torch"] * 2
    assert len(caught) == (0 if supported else 1)
    assert supported or f"Triton {version} is outside the tested range" in str(caught[0].message)


def test_check_passes_under_the_interpreter():
    """`python kernel.py --check`, at sizes the interpreter manages (fp32 only there): every line PASS."""
    out = subprocess.run([sys.executable, "kernel.py", "--check", "--B=1", "--H=2", "--D=16", "--check_T=70",
                          "--check_windows=1,20"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if "max err" in line]
    assert len(lines) == 6 and all(line.endswith("PASS") for line in lines), out.stdout  # 3 kinds x 2 windows
    assert "all checks PASS" in out.stdout


# -----------------------------------------------------------------------------
# Ahead-of-time compiles for real GPUs: the configuration choose_tiling picks for each target
# fits its shared memory, and fp16/bf16 never spill registers.

# shared memory a block may opt into (CUDA programming guide's table; AMD's LDS), in bytes
TARGETS = {"sm_75": kernel.Target("cuda", 75, 64 * 1024), "sm_80": kernel.Target("cuda", 80, 163 * 1024),
           "sm_86": kernel.Target("cuda", 86, 99 * 1024), "sm_89": kernel.Target("cuda", 89, 99 * 1024),
           "sm_90": kernel.Target("cuda", 90, 227 * 1024), "gfx942": kernel.Target("hip", "gfx942", 64 * 1024)}
if "amd" not in triton.backends.backends:
    del TARGETS["gfx942"]
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
KERNELS = ("forward", "backward", "forward value", "backward value")


def compile_kernel(job):
    """(shared bytes, registers, spilled bytes, seconds) of one kernel compiled for one target.
    Runs in a fresh process without TRITON_INTERPRET, so that kernel.py's kernels are JIT functions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    name, dtype, D, which = job
    target = TARGETS[name]
    config = kernel.choose_tiling(dtype, D, target)
    if which.startswith("forward"):
        fn, consts = kernel._attn_fwd, dict(D=D, TILE_M=config.tile_m, TILE_N=config.tile_n)
    else:
        fn, consts = kernel._attn_bwd, dict(D=D, TILE_FIXED=config.tile_fixed, TILE_LOOP=config.tile_loop)
    # as launched for SA: pos strides (.., 1); "value" = the value rule's variant (r and key spans)
    consts.update(HAS_POS=True, HAS_R=which.endswith("value"), PRECISION=config.precision, pos_stride_t=1)
    signature = {n: "constexpr" if n in consts else PTR[dtype] if n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")
                 else "*fp32" if n in ("LSE", "RowDot", "R") else "*i64" if n == "Pos" else "*i32" if n == "Spans"
                 else "fp32" if n.endswith("scale") or n == "width" else "i32" for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n][0] == "*"}
    triton.knobs.nvidia.dump_ptxas_log = True           # ptxas -v's report is printed: registers and spills
    log, start = io.StringIO(), time.perf_counter()
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        triton.knobs.cache.dir = cache                  # a fresh cache, so that ptxas really runs
        compiled = triton.compile(ASTSource(fn, signature, consts, aligned),
                                  target=GPUTarget(target.backend, target.arch, 64 if target.backend == "hip" else 32),
                                  options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    if target.backend == "hip":                         # the code object's metadata; spills counted in 4-byte words
        report = compiled.asm["amdgcn"]
        regs = int(re.search(r"\.vgpr_count:\s+(\d+)", report).group(1))
        spills = 4 * int(re.search(r"\.vgpr_spill_count:\s+(\d+)", report).group(1))
    else:
        report = log.getvalue()
        regs = int(re.search(r"Used (\d+) registers", report).group(1))
        spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return compiled.metadata.shared, regs, spills, time.perf_counter() - start


def compile_table(jobs, monkeypatch):
    """Compile jobs (target name, dtype, D, "forward" or "backward") with choose_tiling's configuration,
    print the table, and assert: within the configuration's shared_kb (so within the target's shared
    memory), no register spills for fp16/bf16. Where choose_tiling declines a target, so does the table."""
    declined = {}
    for job in jobs:
        try:
            kernel.choose_tiling(job[1], job[2], TARGETS[job[0]])
        except kernel.Unsupported as e:
            declined[job] = str(e)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, without its warning
    todo = [job for job in jobs if job not in declined]
    with multiprocessing.get_context("spawn").Pool(os.cpu_count()) as pool:
        results = dict(zip(todo, pool.map(compile_kernel, todo)))
    print(f"\nTriton {triton.__version__}\n{'target':>7} {'dtype':>9} {'D':>4} {'kernel':>14} {'shared KB':>10} "
          f"{'regs':>5} {'spills B':>9} {'compile s':>10}")
    for job in jobs:
        name, dtype, D, which = job
        row = f"{name:>7} {str(dtype)[6:]:>9} {D:>4} {which:>14} "
        if job in declined:
            print(row + "torch path: " + declined[job].split(": ", 1)[-1])
            continue
        shared, regs, spills, seconds = results[job]
        print(row + f"{shared / 1024:>10.1f} {regs:>5} {spills:>9} {seconds:>10.1f}")
    for (name, dtype, D, which), (shared, regs, spills, seconds) in results.items():
        config = kernel.choose_tiling(dtype, D, TARGETS[name])
        assert shared <= config.shared_kb * 1024, f"{name} {dtype} D={D} {which}: {shared} bytes of shared memory"
        assert dtype == torch.float32 or spills == 0, f"{name} {dtype} D={D} {which}: {spills} bytes spilled"
    assert all(name == "sm_75" for name, *_ in declined), declined


def test_compiles_for_sm86(monkeypatch):
    """The quick version: bf16 at D=128 (the largest fp16/bf16 tiles) for the 99 KB GPUs (RTX 30xx/40xx, L4),
    both rules."""
    compile_table([("sm_86", torch.bfloat16, 128, which) for which in KERNELS], monkeypatch)


@pytest.mark.slow
def test_compiles_for_every_target(monkeypatch):
    compile_table([(name, dtype, D, which) for name in TARGETS for dtype in PTR for D in (64, 128)
                   for which in KERNELS], monkeypatch)


# -----------------------------------------------------------------------------
# The self-check (kernel.SELF_CHECK): the interpreter plays the GPU. A correct kernel passes; each
# fault below, injected alone, is caught: "auto" warns and runs the torch path, "triton" raises.

def kernel_mask(T, width, pos=None, val=None):
    """kernel.dense's mask, read back: zero scores and v = the identity give each visible key 1 / (its count)."""
    z = torch.zeros(1, 1, T, T)
    return kernel.dense(z, z, torch.eye(T)[None, None], width, pos, val)[0, 0] > 0   # (T, T)


def test_kernel_masks_equal_attentions():
    """The kernel keeps its own copy of the rule (kernel.py imports nothing from the repo): in slot order, the
    same masks as attention.swa_mask, sa_mask and sa_value_mask."""
    T, window, g = 50, 7, torch.Generator().manual_seed(0)
    perm, r = torch.randperm(T, generator=g), torch.rand(T, generator=g)
    slots = torch.argsort(r)
    assert torch.equal(kernel_mask(T, window), A.swa_mask(T, window))
    assert torch.equal(kernel_mask(T, window, perm), A.swa_mask(T, window, perm))
    assert torch.equal(kernel_mask(T, window, perm), A.sa_mask(window, perm)[perm][:, perm])
    assert torch.equal(kernel_mask(T, 0.1, slots, r[slots]), A.sa_value_mask(0.1, r)[slots][:, slots])


def test_a_correct_kernel_passes_the_self_check(monkeypatch):
    """impl_line() runs the self-check of each kernel variant a model uses, once, and says so; on the CPU under "auto" it runs
    no kernel at all."""
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    assert A.impl_line("cpu", torch.float32, 16, ["sa+swa"]) == "attention: the torch path on cpu"
    assert kernel.SELF_CHECKS == {}
    monkeypatch.setattr(A, "IMPL", "triton")
    for kinds, rule in ((["sa+swa"], "rank"), (["sa", "full"], "value")):
        line = A.impl_line("cpu", torch.float32, 16, kinds, rule)
        assert re.fullmatch(r"attention: Triton kernel, self-check passed on the CPU interpreter float32 "
                            r"\(max err \d\.\de-0[5-9], [\d.]+ s\)", line), line
        print(line)
    assert {key[3]: err < 1e-4 for key, err in kernel.SELF_CHECKS.items()} == \
        {"swa": True, "sa rank": True, "sa value": True}
    assert A.impl_line("cpu", torch.float32, 16, ["full", "moba"]) == "attention: no SWA or SA on cpu"


def inject(monkeypatch, fault, dtype=None):
    """One fault in the kernel, for dtype only if given: the band one key too wide, a wrong scale (both forward
    and backward), dk or dq 10% off (backward only), or a NaN in the output (forward only). Injected below the ops,
    so that the self-check, which calls them (kernel._forward, kernel._backward), meets the fault as a call does."""
    launch_args, backward, forward = kernel._launch_args, kernel._backward, kernel._attn_fwd
    hit = lambda q: dtype is None or q.dtype == dtype  # noqa: E731

    def wide(q, pos, r, width, *a):
        return launch_args(q, pos, r, width + (1 if r is None else 1 / q.shape[2]) * hit(q), *a)

    class NanRow:  # _attn_fwd[grid](q, k, v, o, ...): then a NaN in o's row 7
        def __getitem__(self, grid):
            def launch(q, k, v, o, *a, **kw):
                forward[grid](q, k, v, o, *a, **kw)
                if hit(q):
                    o[:, :, 7] = float("nan")
            return launch

    def off(i):
        return lambda do, *a: tuple(g * 1.1 if j == i and hit(g) else g for j, g in enumerate(backward(do, *a)))
    if fault == "scale":
        monkeypatch.setattr(kernel, "LOG2E", kernel.LOG2E * 1.05)
    else:
        monkeypatch.setattr(*{"window": (kernel, "_launch_args", wide), "nan": (kernel, "_attn_fwd", NanRow()),
                              "dq": (kernel, "_backward", off(0)), "dk": (kernel, "_backward", off(1))}[fault])


@pytest.mark.parametrize("fault, kind", [("window", "swa"), ("scale", "sa"), ("dk", "sa-value"), ("dq", "swa"),
                                         ("nan", "sa")])
def test_the_self_check_catches_a_faulty_kernel(monkeypatch, fault, kind):
    """Under "triton" the first call raises, naming the device, dtype, kernel variant and error; under "auto" (here the
    interpreter plays a GPU) one warning says so and the torch path gives the reference's output and gradients,
    which the faulty kernel, unchecked, does not."""
    fast, ref = attention_kinds(100, B=1, H=2)[kind]
    q, k, v = qkv(1, 2, 100, 16, device=KDEV)
    inject(monkeypatch, fault)
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "IMPL", "triton")
    rule = {"swa": "swa", "sa": "sa rank", "sa-value": "sa value"}[kind]
    message = f"failed its self-check on the CPU interpreter float32 for {rule} .*against the dense fp32 reference"
    with pytest.raises(kernel.Unsupported, match=message):
        fast(q, k, v)
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "IMPL", "auto")
    monkeypatch.setattr(A, "_impl", lambda q: "triton")   # as "auto" decides for a CUDA tensor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # as a user's Python: a warning once per place and text
        assert_same(fast, q, k, v, ref)
        fast(q, k, v)
    failures = [str(w.message) for w in caught if "self-check" in str(w.message)]
    assert len(failures) == 1 and re.search("torch path instead: Unsupported: the Triton kernel " + message,
                                            failures[0]), failures
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(kernel, "SELF_CHECK", False)  # and the fault is real: unchecked, the kernel runs it
    with pytest.raises(AssertionError):
        assert_same(fast, q, k, v, ref)


@pytest.mark.parametrize("fault", [None, "window"])
def test_a_compiled_model_runs_the_self_check(monkeypatch, fault):
    """Compiled, with no eager call before it, the kernel's first call still runs its self-check, and a faulty kernel
    refuses to run: the op runs check_once, and the compiled graph calls the op (the check used to be skipped when it
    was traced, under torch.compile)."""
    calls, check = [], kernel.self_check
    monkeypatch.setattr(kernel, "self_check", lambda *a, **kw: calls.append(a[3]) or check(*a, **kw))
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "IMPL", "triton")
    if fault:
        inject(monkeypatch, fault)
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    torch._dynamo.reset()
    swa = torch.compile(lambda q, k, v: A.sliding_window_attention(q, k, v, 8), backend="aot_eager", fullgraph=True)
    if fault:
        with pytest.raises(kernel.Unsupported, match="failed its self-check"):
            swa(q, k, v)
    else:
        assert_same(swa, q, k, v, lambda *x: A.swa_reference(*x, 8))
    assert calls == ["swa"]


def test_the_self_check_runs_once_per_key(monkeypatch):
    """Five calls of two rules: two self-checks, not five."""
    calls = []
    check = kernel.self_check
    monkeypatch.setattr(kernel, "self_check", lambda *a, **kw: calls.append(a[1:4]) or check(*a, **kw))
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "IMPL", "triton")
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    perm = random_perm((), 50, device=KDEV)
    for _ in range(3):
        A.sliding_window_attention(q, k, v, 8)
    for _ in range(2):
        A.stochastic_attention(q, k, v, 8, perm)
    assert calls == [(torch.float32, 16, "swa"), (torch.float32, 16, "sa rank")]


@pytest.mark.parametrize("faulty", [torch.bfloat16, torch.float32])
def test_a_failed_dtype_leaves_the_other_alone(monkeypatch, bf16_dot, faulty):
    """A kernel wrong in one dtype only: that dtype warns and takes the torch path, the other keeps the kernel."""
    inject(monkeypatch, "window", faulty)
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "_impl", lambda q: "triton")
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    with pytest.warns(UserWarning, match=f"self-check on the CPU interpreter {str(faulty)[6:]} for swa"):
        for dtype in (torch.bfloat16, torch.float32):
            A.sliding_window_attention(q.to(dtype), k.to(dtype), v.to(dtype), 8)
    assert {key[1]: err <= kernel.TOLERANCE[key[1]] for key, err in kernel.SELF_CHECKS.items()} == \
        {torch.bfloat16: faulty != torch.bfloat16, torch.float32: faulty != torch.float32}
    for dtype in (torch.bfloat16, torch.float32):
        line = A.impl_line("cpu", dtype, 16, ["swa"])
        failed = f"attention: the torch path for swa on the CPU interpreter {str(dtype)[6:]}: Unsupported: the Triton"
        assert line.startswith(failed + " kernel failed" if dtype == faulty else "attention: Triton kernel"), line


def test_triton_swa_two_sided_band_one_short_of_a_key_tile(small_blocks):
    """A two-sided band (pos given) whose right edge, start + window - 1, ends one key before a key tile starts
    (window 31, tiles of 16 and 32): the interior region, run without the band mask, must stop a tile short."""
    q, k, v, pos = kernel_case(1, 2, 100, 16, torch.float32, "perm")
    assert_same(lambda *x: kernel.triton_swa(*x, 31, pos), q, k, v, lambda *x: A.swa_reference(*x, 31, pos))


def test_value_sa_through_triton_hides_keys_at_exactly_delta(small_blocks, monkeypatch):
    """r multiples of 1/64, delta = 1/8: pairs at exactly delta in fp32, which the kernel's strict < hides."""
    monkeypatch.setattr(A, "IMPL", "triton")
    T, delta = 64, 0.125
    r = random_perm((), T, device=KDEV).float() / T
    q, k, v = qkv(1, 2, T, 16, device=KDEV)
    assert_same(lambda *x: A.stochastic_value_attention(*x, delta, r), q, k, v,
                lambda *x: A.sa_value_reference(*x, delta, r))


def test_kernel_value_spans_equal_tiled_at_the_edge_of_delta():
    """The copies agree where VALUE_MARGIN matters: keys within ulps of delta (random r almost never are)."""
    for seed, tile in itertools.product(range(10), (16, 32, 64)):
        r = edge_pairs(200, 0.1, seed).sort().values[None]  # (1, T)
        spans = [module.value_spans(r, 0.1, A.VALUE_MARGIN, tile) for module in (kernel, tiled)]
        assert all(torch.equal(got, want) for got, want in zip(*spans)), (seed, tile)
