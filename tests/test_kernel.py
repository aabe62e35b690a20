"""Tests for kernel.py, the Triton kernel: on the CPU under TRITON_INTERPRET=1 (set by conftest.py),
and compiled ahead of time for real GPUs with Triton's bundled ptxas (no GPU needed).
Run: python -m pytest -q tests/test_kernel.py   (add --slow for the compile table of every target)"""
import ast
import contextlib
import importlib.util
import inspect
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
from torch.utils._python_dispatch import TorchDispatchMode

import attention as A
import gpu_check
from guards import InputError, checked
from test_attention import (assert_same, attention_kinds, edge_pairs, out_and_grads, qkv, random_perm,
                            test_compiled_training_equals_eager, tiny)

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernel tests need it")
import kernel  # noqa: E402  (after the skip)
import triton.language as tl  # noqa: E402

# the interpreter also computes padding rows past T, which may see no key (0 / 0); they are never stored
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
KDEV = "cuda" if torch.cuda.is_available() else "cpu"  # conftest.py turns on the interpreter without a GPU
# small tiles, so that T <= 130 spans several tiles: edge and interior tiles are both exercised
SMALL = kernel.Tiling(32, 16, 32, 16, num_warps=4, num_stages=2, precision=None, min_shared_kb=0)


@pytest.fixture
def small_blocks(monkeypatch):
    choose = kernel.choose_tiling
    monkeypatch.setattr(kernel, "choose_tiling", lambda *a: SMALL._replace(precision=choose(*a).precision))


def kernel_case(B, H, T, D, dtype, perm_kind):
    q, k, v = qkv(B, H, T, D, dtype=dtype, device=KDEV)
    perm = {"none": None, "perm": random_perm((), T, device=KDEV), "bht": random_perm((B, H), T, device=KDEV)}
    return q, k, v, perm[perm_kind]


def reference(window, perm):
    """triton_swa's rule in token order: SWA without perm, SA's rank rule with it."""
    return lambda *x: A.swa_reference(*x, window) if perm is None else A.sa_reference(*x, window, perm)


# Every T meets every window once; the perm kind rotates so it meets every T and every window too.
PERM_KINDS = ("none", "perm", "bht")
KERNEL_CASES = [(T, w, PERM_KINDS[(i + j) % 3]) for i, T in enumerate((1, 17, 100, 130))
                for j, w in enumerate((1, 16, 33, 1000))]


@pytest.mark.parametrize("T, window, perm_kind", KERNEL_CASES)
def test_triton_swa_matches_reference_fp32(small_blocks, T, window, perm_kind):
    q, k, v, perm = kernel_case(2 if perm_kind == "bht" else 1, 2, T, 16, torch.float32, perm_kind)
    assert_same(lambda *x: kernel.triton_swa(*x, window, perm), q, k, v, reference(window, perm))


@pytest.fixture
def bf16_dot(monkeypatch):
    """triton's interpreter keeps bf16 as raw uint16 and its tl.dot multiplies the bit
    patterns (triton-lang/triton#11584, unsupported upstream). Upcast bf16 dot operands
    to fp32 first, as the GPU's tensor cores effectively do. No-op on a GPU."""
    if KDEV == "cuda":
        return
    from triton.runtime import interpreter
    builder, dot = interpreter.interpreter_builder, interpreter.interpreter_builder.create_dot

    def create_dot(a, b, *rest):
        a, b = (builder.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(a, b, *rest)
    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.mark.parametrize("T, window, perm_kind, dtype", [
    (1, 1, "perm", torch.bfloat16), (17, 16, "none", torch.bfloat16), (100, 1000, "perm", torch.bfloat16),
    (130, 33, "bht", torch.bfloat16), (100, 33, "perm", torch.float16)])
def test_triton_swa_half_precision(small_blocks, bf16_dot, T, window, perm_kind, dtype):
    """Half-precision inputs against the fp32 reference on the same (rounded) values."""
    q, k, v, perm = kernel_case(2 if perm_kind == "bht" else 1, 2, T, 16, dtype, perm_kind)
    assert_same(lambda *x: kernel.triton_swa(*x, window, perm), q, k, v, reference(window, perm))


def test_triton_swa_head_dim_64(small_blocks):
    q, k, v, perm = kernel_case(1, 1, 100, 64, torch.float32, "perm")
    assert_same(lambda *x: kernel.triton_swa(*x, 33, perm), q, k, v, reference(33, perm))


def test_triton_swa_default_tiling():
    """The tiling choose_tiling gives (here the sm_80 one), not only the small test tiles."""
    q, k, v, perm = kernel_case(1, 1, 300, 64, torch.float32, "perm")
    assert_same(lambda *x: kernel.triton_swa(*x, 100, perm), q, k, v, reference(100, perm))


@pytest.mark.parametrize("perm_shape", [(), (2, 1)])
def test_stochastic_attention_through_triton(small_blocks, monkeypatch, perm_shape):
    """SA end to end, one launch reading and writing rows through perm == the dense SA reference."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    q, k, v = qkv(2, 2, 100, 16, device=KDEV)
    perm = random_perm(perm_shape, 100, device=KDEV)
    assert_same(lambda *x: A.stochastic_attention(*x, 16, perm), q, k, v, lambda *x: A.sa_reference(*x, 16, perm))


@pytest.mark.parametrize("T, window, r_shape, dtype", [(1, 3, (), torch.float32), (100, 16, (), torch.float32),
                                                   (130, 40, (2, 2), torch.float32), (100, 1000, (), torch.float32),
                                                   (100, 16, (2, 1), torch.bfloat16)])
def test_value_sa_through_triton(small_blocks, bf16_dot, monkeypatch, T, window, r_shape, dtype):
    """SA's value rule end to end: sorted by r, the kernel's per-tile key spans (a bisection of r in the kernel)
    and its |r_i - r_j| < width mask == the dense reference, forward and backward."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    q, k, v = qkv(2, 2, T, 16, dtype=dtype, device=KDEV)
    r = torch.rand(*r_shape, T, generator=torch.Generator().manual_seed(T)).to(KDEV)
    assert_same(lambda *x: A.stochastic_value_attention(*x, window / T, r), q, k, v,
                lambda *x: A.sa_value_reference(*x, window / T, r))


@pytest.mark.parametrize("kind, T", [("sa", 130), ("sa-bht", 17), ("sa-value", 17), ("sa-value-bht", 130)])
def test_the_fused_kernel_equals_the_recipe(small_blocks, monkeypatch, kind, T):
    """SA in one launch (ATTN_ENGINE "triton") against the three-line recipe it replaces (ATTN_ENGINE "torch": gather, the band,
    gather back), forward and gradients: both rules, one permutation or r shared and one per head, lengths no multiple
    of a tile."""
    fast = attention_kinds(T, B=2, H=2)[kind][0]
    q, k, v = qkv(2, 2, T, 16, device=KDEV)
    monkeypatch.setattr(A, "ATTN_ENGINE", "torch")
    want = out_and_grads(fast, q, k, v)
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    for name, got, expected in zip(("out", "dq", "dk", "dv"), out_and_grads(fast, q, k, v), want):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_check_once_refuses_a_head_dim_it_has_no_kernel_for(monkeypatch):
    """engine_line under ATTN_ENGINE "triton" at head dim 24: one line (an InputError) naming the head dims, not a Triton
    traceback nor kernel.Unsupported's."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    with pytest.raises(InputError, match="attn_engine 'triton': Unsupported: .*head dim"):
        A.engine_line(KDEV, torch.float32, 24, ["swa"])


def test_triton_swa_reads_r_by_its_own_strides(small_blocks):
    """r laid out unlike perm (same shape, other strides): the kernels read r with perm's strides, so one is copied."""
    q, k, v = qkv(2, 2, 40, 16, device=KDEV)
    r, perm = torch.rand(2, 2, 40, generator=torch.Generator().manual_seed(0)).to(KDEV).sort()
    r_t = r.transpose(0, 1).contiguous().transpose(0, 1)  # (B, H, T), H outermost in memory
    assert r_t.stride() != perm.stride()
    torch.testing.assert_close(kernel.triton_swa(q, k, v, 0.2, perm, r_t), kernel.triton_swa(q, k, v, 0.2, perm, r))


@pytest.mark.parametrize("r, width, problem", [(torch.rand(8).sort().values.double(), 0.1, "r must be fp32"),
                                                 (torch.rand(8).sort().values, 0.0, "width > 0")])
def test_triton_swa_rejects_bad_r(r, width, problem):
    """Its shape and dtype; that r ascends is attention.py's to make (a sort), not read here: a sync on a GPU."""
    q = torch.zeros(1, 2, 8, 16, device=KDEV)
    with pytest.raises(ValueError, match=problem):
        kernel.triton_swa(q, q, q, width, torch.arange(8, device=KDEV), r.to(KDEV))


@pytest.mark.parametrize("D, window, perm, problem", [
    (24, 4, None, "head dims"), (16, 4, torch.arange(9), "perm"),
    (16, 4, torch.arange(8).int(), "perm"), (16, 4, torch.arange(8).view(4, 1, 1, 2), "perm")])
def test_triton_swa_rejects_bad_input(D, window, perm, problem):
    q = torch.zeros(1, 2, 8, D, device=KDEV)
    with pytest.raises(ValueError, match=problem):
        kernel.triton_swa(q, q, q, window, None if perm is None else perm.to(KDEV))


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
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    fast, ref = attention_kinds(100, B=2, H=2)[kind]
    q, k, v = qkv(2, 2, 100, 16, device=KDEV)
    with torch.autocast(KDEV, dtype=dtype):
        got, want = out_and_grads(fast, q, k, v), out_and_grads(ref, q, k, v)
    assert got[0].dtype == dtype
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=6e-2, rtol=5e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["swa", "sa", "sa-value"])
def test_kernel_nan_key_reaches_only_the_queries_that_see_it(small_blocks, monkeypatch, kind):
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    fast, ref = attention_kinds(100, window=4, B=1, H=2)[kind]
    q, k, v = (t.detach() for t in qkv(1, 2, 100, 16, device=KDEV))
    k[:, :, 70] = float("nan")
    want = ref(q, k, v).isnan().any(-1)
    assert want.any() and not want[..., :70].any()
    assert torch.equal(fast(q, k, v).isnan().any(-1), want)


@pytest.mark.parametrize("kind", ["swa", "sa", "sa-value"])
def test_kernel_bad_value_reaches_every_query_that_sees_it(small_blocks, monkeypatch, kind):
    """A NaN or inf in v[j, d] makes out[i, d] non-finite wherever query i sees key j; the kernel keeps no more (a
    check would wait for the GPU): other queries of its tiles may meet it too (0 * NaN = NaN), as SDPA's do."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    fast, ref = attention_kinds(100, window=4, B=1, H=2)[kind]
    q, k, v = (t.detach() for t in qkv(1, 2, 100, 16, device=KDEV))
    for j, bad in itertools.product((0, 50, 99), (float("nan"), float("inf"))):
        vb = v.clone()
        vb[:, :, j, ::2] = bad
        want = ~ref(q, k, vb).isfinite()
        assert want.any() and not (~fast(q, k, vb).isfinite() < want).any(), (j, bad)  # every query that sees it


# -----------------------------------------------------------------------------
# Where the kernel runs: ATTN_ENGINE="auto" decides once per (device, dtype, head dim, rule), before any call, from the
# kernel's checks (check_once), so that a compiled graph never holds a kernel that refuses; where they fail it warns
# once and takes the torch engine. ATTN_ENGINE="triton" raises. A bug in the kernel raises under both. Here the interpreter
# plays a GPU (plays_a_gpu).

def play_a_gpu(monkeypatch):
    """ATTN_ENGINE "auto" as on a GPU: the interpreter runs the kernel, from a fresh self-check."""
    monkeypatch.setattr(A, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(A, "ATTN_ENGINE", "auto")
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})


@pytest.fixture
def plays_a_gpu(monkeypatch):
    play_a_gpu(monkeypatch)


def oom(*args):
    raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")


@pytest.mark.parametrize("cause, match", [("shared memory", "the GPU offers 16 KB"), ("sm_75", "no tensor-core dot"),
                                          ("out of resources", "out of resource: shared memory")])
def test_auto_falls_back_to_torch(monkeypatch, plays_a_gpu, cause, match):
    if cause == "out of resources":  # as a compile for a GPU may fail
        monkeypatch.setattr(kernel, "choose_tiling", oom)
    else:  # a GPU with 16 KB (no tiling fits), or a T4
        monkeypatch.setattr(kernel, "INTERPRETER", kernel.Target("cuda", 75 if cause == "sm_75" else 80, 16 * 1024))
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    perm, r = random_perm((), 50, device=KDEV), torch.rand(50, device=KDEV)
    line = A.engine_line(KDEV, torch.float32, 16, ["sa+swa"])
    assert re.fullmatch(f"attention: the torch engine for swa, sa rank on the CPU interpreter float32: .*{match}.*",
                        line), line
    for fast, ref in ((lambda *x: A.stochastic_attention(*x, 8, perm), lambda *x: A.sa_reference(*x, 8, perm)),
                      (lambda *x: A.stochastic_value_attention(*x, 0.2, r),
                       lambda *x: A.sa_value_reference(*x, 0.2, r))):
        with pytest.warns(UserWarning, match=f"torch engine instead: .*{match}"):
            assert_same(fast, q, k, v, ref)
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    with pytest.raises(Exception, match=match):
        A.stochastic_attention(q, k, v, 8, perm)


def test_auto_keeps_the_kernel_under_its_int32_offsets(plays_a_gpu):
    """H * T * D of 2**31 or more: "auto" takes the torch engine (the kernel would raise Unsupported)."""
    zero = torch.zeros((), device=KDEV)
    assert A._engine(zero.expand(1, 2**14, 2**13 - 1, 16), "sa rank") == "triton"  # (B, H, T, D), no memory
    assert A._engine(zero.expand(1, 2**14, 2**13, 16), "sa rank") == "torch"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes rows past T too (0 / 0)
def test_a_compiled_model_on_a_t4_takes_the_torch_engine(monkeypatch, plays_a_gpu):
    """train.py compiles on CUDA. On an sm_75 GPU the compiled graph held the kernel's op, which refused at the first
    forward (Unsupported), right after engine_line had said "the torch engine". Now the engine is decided before
    tracing: one warning, no graph break, and the torch engine's losses."""
    monkeypatch.setattr(kernel, "INTERPRETER", kernel.Target("cuda", 75, 64 * 1024))
    x = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(0))
    eager = tiny("sa+swa")(x[:, :-1], x[:, 1:])[1]
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="torch engine instead: Unsupported: sm_75"):
        compiled = torch.compile(tiny("sa+swa"), backend="aot_eager", fullgraph=True)(x[:, :-1], x[:, 1:])[1]
    assert compiled.item() == pytest.approx(eager.item(), abs=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_compiled_model_runs_the_kernel_in_one_graph(monkeypatch, plays_a_gpu):
    """Under "auto" on a GPU that passes the checks: SA+SWA through the kernel, compiled with no graph break, equal to
    eager through the kernel (fwd and bwd)."""
    x = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    assert torch._dynamo.explain(tiny("sa+swa", sa_draw="head"))(x, x).graph_break_count == 0
    test_compiled_training_equals_eager("sa+swa", "rank", steps=2, T=20)
    assert {case[3] for case in kernel.SELF_CHECKS} == {"swa", "sa rank"}  # "auto" ran the kernel


def test_a_kernel_bug_raises_under_auto(monkeypatch, plays_a_gpu):
    """A kernel that fails for a reason other than the GPU's limits (here: tiles of 48 rows, no power of 2) must
    raise, not hide behind the torch engine."""
    monkeypatch.setattr(kernel, "choose_tiling", lambda *a: SMALL._replace(tile_m=48))
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    with pytest.raises(Exception, match="power of 2"):
        A.sliding_window_attention(q, k, v, 8)


@pytest.mark.parametrize("error", [ValueError, kernel.Unsupported])
def test_only_unsupported_falls_back_under_auto(monkeypatch, plays_a_gpu, error):
    """Under "auto", the kernel declining a GPU, dtype or shape (Unsupported, from its checks) takes the torch engine
    with a warning; a plain ValueError raised in them is a bug, and raises."""
    def self_check(*args, **kw):
        raise error("raised inside the kernel")
    monkeypatch.setattr(kernel, "self_check", self_check)
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    if error is ValueError:
        with pytest.raises(ValueError, match="raised inside the kernel"):
            A.sliding_window_attention(q, k, v, 8)
    else:
        with pytest.warns(UserWarning, match="torch engine instead: Unsupported: raised inside the kernel"):
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


def test_the_kernels_band_edges_are_the_rule():
    """kernel.py keeps its own band edges (it imports nothing from the repo): slots i - left ... i + right are those
    that attention.rule_mask's |i - j| < window keeps, both ways (SA) or, causal SWA, back only; edge cases included."""
    for window, T, two_sided in itertools.product((1, 5, 100, 300), (1, 7, 100), (False, True)):
        left, right = kernel.band_edges(float(window), T, two_sided)
        i = torch.arange(T)
        pos = torch.zeros(T, dtype=torch.long) if two_sided else i  # equal positions: no causal cut
        band = (i[None, :] >= i[:, None] - left) & (i[None, :] <= i[:, None] + right)  # (T, T): query i, key j
        assert torch.equal(band, A.rule_mask(i, pos, min(window, T))), (window, T, two_sided)


class FakeCudaTensor:
    is_cuda, shape, dtype, device = True, (1, 2, 8, 64), torch.bfloat16, torch.device("cuda")


@pytest.fixture
def triton_read_anew():
    """attention._triton_supported reads Triton's version once: here anew, and again after the test."""
    A._triton_supported.cache_clear()
    yield
    A._triton_supported.cache_clear()


def test_choosing_the_kernel_adds_no_graph_break(monkeypatch, plays_a_gpu, triton_read_anew):
    """torch 2.11's Dynamo skips importlib.util.find_spec (2.13's folds it): on an H200, a graph break in every
    attention call, and GPT.forward left eager. Played here by a find_spec that Dynamo may not trace: what chooses the
    engine is a constant to torch.compile ("auto": _kernel_ok; "triton": _has_triton)."""
    find_spec = torch.compiler.disable(importlib.util.find_spec)
    monkeypatch.setattr(A, "importlib", types.SimpleNamespace(util=types.SimpleNamespace(find_spec=find_spec)))
    for engine in ("auto", "triton"):
        monkeypatch.setattr(A, "ATTN_ENGINE", engine)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # and no warning (the interpreter's numpy ones aside)
            swa = torch.compile(lambda q, k, v: A.sliding_window_attention(q, k, v, 4), fullgraph=True, backend="eager")
            assert_same(swa, *qkv(1, 2, 20, 16, device=KDEV), lambda *x: A.swa_reference(*x, 4))


@pytest.mark.parametrize("version, supported", [("3.2.0", True), ("3.6.0", True), ("3.9.1", True), ("3.1.0", False),
                                                ("2.3.1", False), ("3.10.0", False), ("4.0.0", False)])
def test_auto_uses_the_kernel_only_with_a_tested_triton(monkeypatch, triton_read_anew, version, supported):
    """attention.ATTN_ENGINE = "auto" on a CUDA tensor: the kernel with a Triton in attention.TRITON_VERSIONS; otherwise
    the torch engine and one warning (the version is read once, not per call)."""
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(kernel, "check_once", lambda *a: None)  # no CUDA here to check
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [A._engine(FakeCudaTensor(), "swa") for _ in range(2)] == ["triton" if supported else "torch"] * 2
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

# shared memory a program (a CUDA thread block) may opt into (CUDA programming guide's table; AMD's LDS), in bytes
TARGETS = {"sm_75": kernel.Target("cuda", 75, 64 * 1024), "sm_80": kernel.Target("cuda", 80, 163 * 1024),
           "sm_86": kernel.Target("cuda", 86, 99 * 1024), "sm_89": kernel.Target("cuda", 89, 99 * 1024),
           "sm_90": kernel.Target("cuda", 90, 227 * 1024), "gfx942": kernel.Target("hip", "gfx942", 64 * 1024)}
if "amd" not in triton.backends.backends:
    del TARGETS["gfx942"]
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
KERNELS = ("forward swa", "backward swa", "forward sa", "backward sa", "forward value", "backward value", "rowdot sa")
FORWARD = ("tile_m", "tile_n", "num_warps", "num_stages", "one_loop", "spans_first")  # kernel.Tiling's fields by kernel
BACKWARD = ("tile_fixed", "tile_loop", "bwd_warps", "bwd_stages", "one_loop", "dq_atomic", "spans_first")


def candidate_kernels(candidate):
    """The kernels gpu_check.CANDIDATES[candidate] (a tiling, variants) compiles unlike choose_tiling's tiling."""
    fields = set(gpu_check.CANDIDATES[candidate])
    rules = ("value",) if fields == {"spans_first"} else ("swa", "sa", "value")  # the switch of the value rule only
    return [f"{kind} {rule}" for kind, names in (("forward", FORWARD), ("backward", BACKWARD)) if fields & set(names)
            for rule in rules] + ["spans value"] * ("spans_first" in fields)


def compile_kernel(job):
    """(shared bytes, registers, spilled bytes, seconds) of one kernel compiled for one target, by choose_tiling's
    tiling or one of gpu_check.CANDIDATES (an index; None: none). Runs in a fresh process without TRITON_INTERPRET, so
    that kernel.py's kernels are JIT functions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    name, dtype, D, which, candidate = job
    (kind, rule), target = which.split(), TARGETS[name]
    tiling = kernel.choose_tiling(dtype, D, target)._replace(**gpu_check.CANDIDATES[candidate or 0])
    warps, stages = {"backward": (tiling.bwd_warps or tiling.num_warps, tiling.bwd_stages or tiling.num_stages),
                     "spans": (1, tiling.num_stages)}.get(kind, (tiling.num_warps, tiling.num_stages))
    fn, consts = {"forward": (kernel._attn_fwd, dict(TILE_M=tiling.tile_m, TILE_N=tiling.tile_n)),
                  "backward": (kernel._attn_bwd, dict(TILE_FIXED=tiling.tile_fixed, TILE_LOOP=tiling.tile_loop,
                                                      DQ_ATOMIC=tiling.dq_atomic)),
                  "rowdot": (kernel._rowdot, dict(TILE=tiling.tile_fixed)),
                  "spans": (kernel._value_spans, dict(TILE_FIXED=tiling.tile_fixed, TILE_LOOP=tiling.tile_loop))}[kind]
    # as launched: swa without perm, sa with it, value with perm and r; T and the strides multiples of 16, as Triton's
    # launcher marks a model's in training (q, k, v: (T * 3C, hs, 3C); o: (T * C, hs, C)); kernel.ANY's ints unmarked
    if kind != "spans":
        consts.update(D=D, HAS_PERM=rule != "swa")
    if kind in ("forward", "backward"):
        consts.update(HAS_R=rule == "value", ONE_LOOP=tiling.one_loop, PRECISION=tiling.precision,
                      SPANS_FIRST=tiling.spans_first and rule == "value")
    signature = {n: "constexpr" if n in consts else "*fp32" if n == "DQ" and tiling.dq_atomic
                 else PTR[dtype] if n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")
                 else "*fp32" if n in ("LSE", "RowDot", "R") else "*i64" if n == "Perm" else "*i32" if n == "Spans"
                 else "fp32" if n.endswith("scale") or n in ("width", "margin") else "i32" for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if signature[n][0] == "*" or n[:3] in ("sq_", "sk_", "sv_", "so_", "sp_") or n == "T"}
    triton.knobs.nvidia.dump_ptxas_log = True           # ptxas -v's report is printed: registers and spills
    log, start = io.StringIO(), time.perf_counter()
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        triton.knobs.cache.dir = cache                  # a fresh cache, so that ptxas really runs
        warp = 64 if target.platform == "hip" else 32
        compiled = triton.compile(ASTSource(fn, signature, consts, aligned),
                                  target=GPUTarget(target.platform, target.arch, warp),
                                  options=dict(num_warps=warps, num_stages=stages))
    if target.platform == "hip":                        # the code object's metadata; spills counted in 4-byte words
        report = compiled.asm["amdgcn"]
        regs = int(re.search(r"\.vgpr_count:\s+(\d+)", report).group(1))
        spills = 4 * int(re.search(r"\.vgpr_spill_count:\s+(\d+)", report).group(1))
    else:
        report = log.getvalue()
        regs = int(re.search(r"Used (\d+) registers", report).group(1))
        spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return compiled.metadata.shared, regs, spills, time.perf_counter() - start


def compile_table(jobs, monkeypatch):
    """Compile jobs (target name, dtype, D, one of KERNELS, a gpu_check.CANDIDATES index or None), print the table,
    and assert: within the tiling's min_shared_kb (a candidate: within the target's shared memory), no register spills
    for fp16/bf16. Where choose_tiling declines a target, so does the table."""
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
          f"{'regs':>5} {'spills B':>9} {'compile s':>10}  candidate (gpu_check.CANDIDATES)")
    for job in jobs:
        name, dtype, D, which, candidate = job
        row = f"{name:>7} {str(dtype)[6:]:>9} {D:>4} {which:>14} "
        if job in declined:
            print(row + "torch engine: " + declined[job].split(": ", 1)[-1])
            continue
        shared, regs, spills, seconds = results[job]
        fields = {} if candidate is None else gpu_check.CANDIDATES[candidate]
        fields = f"  {candidate}: " + " ".join(f"{k}={v}" for k, v in fields.items()) if fields else ""
        print(row + f"{shared / 1024:>10.1f} {regs:>5} {spills:>9} {seconds:>10.1f}{fields}")
    for (name, dtype, D, which, candidate), (shared, regs, spills, seconds) in results.items():
        tiling, target = kernel.choose_tiling(dtype, D, TARGETS[name]), TARGETS[name]
        fits = target.max_shared if candidate else tiling.min_shared_kb * 1024
        assert shared <= fits, f"{name} {dtype} D={D} {which} {candidate}: {shared} bytes of shared memory"
        assert dtype == torch.float32 or spills == 0, f"{name} {dtype} D={D} {which} {candidate}: {spills} B spilled"
    assert all(name == "sm_75" for name, *_ in declined), declined


def test_compiles_for_sm86(monkeypatch):
    """The quick version: bf16 at D=128 (the largest fp16/bf16 tiles) for the 99 KB GPUs (RTX 30xx/40xx, L4),
    every rule; and a few of gpu_check's candidates at D=64."""
    candidates = [(3, "forward sa"), (6, "backward sa"), (8, "backward value"), (8, "spans value")]
    compile_table([("sm_86", torch.bfloat16, 128, which, None) for which in KERNELS] +
                  [("sm_86", torch.bfloat16, 64, which, i) for i, which in candidates], monkeypatch)


@pytest.mark.slow
def test_compiles_for_every_target(monkeypatch):
    """choose_tiling's tiling for every target, dtype and head dim; gpu_check's candidates (bf16, D=64) on each CUDA
    target they are swept on."""
    compile_table([(name, dtype, D, which, None) for name in TARGETS for dtype in PTR for D in (64, 128)
                   for which in KERNELS] +
                  [(name, torch.bfloat16, 64, which, i) for name in TARGETS if name not in ("sm_75", "gfx942")
                   for i in range(1, len(gpu_check.CANDIDATES)) if name == "sm_90" or i not in gpu_check.SM90_ONLY
                   for which in candidate_kernels(i)], monkeypatch)


# -----------------------------------------------------------------------------
# The self-check (kernel.SELF_CHECK): the interpreter plays the GPU. A correct kernel passes; each
# fault below, injected alone, is caught: "auto" warns and runs the torch engine, "triton" raises.

def kernel_mask(T, width, perm=None, r=None):
    """kernel.dense's mask, read back: zero scores and v = the identity give each visible key 1 / (its count)."""
    z = torch.zeros(1, 1, T, T)
    return kernel.dense(z, z, torch.eye(T)[None, None], width, perm, r)[0, 0] > 0   # (T, T)


def test_kernel_masks_equal_attentions():
    """The kernel keeps its own copy of the rule (kernel.py imports nothing from the repo): in token order, the
    masks of attention.swa_mask, sa_mask and sa_value_mask."""
    T, window, g = 50, 7, torch.Generator().manual_seed(0)
    perm, r = torch.randperm(T, generator=g), torch.rand(T, generator=g)
    r_sorted, slots = r.sort()
    assert torch.equal(kernel_mask(T, window), A.swa_mask(T, window))
    assert torch.equal(kernel_mask(T, window, perm), A.sa_mask(window, perm))
    assert torch.equal(kernel_mask(T, 0.1, slots, r_sorted), A.sa_value_mask(0.1, r))


def test_a_correct_kernel_passes_the_self_check(monkeypatch):
    """engine_line() runs the self-check of each kernel rule a model uses, once, and says so; on the CPU under "auto" it
    runs no kernel at all."""
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    assert A.engine_line("cpu", torch.float32, 16, ["sa+swa"]) == "attention: the torch engine on cpu"
    assert kernel.SELF_CHECKS == {}
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    for kinds, rule in ((["sa+swa"], "rank"), (["sa", "full"], "value")):
        line = A.engine_line("cpu", torch.float32, 16, kinds, rule)
        assert re.fullmatch(r"attention: Triton kernel, self-check passed on the CPU interpreter float32 "
                            r"\(max err \d\.\de-0[5-9], [\d.]+ s\)", line), line
        print(line)
    assert {case[3]: err < 1e-4 for case, err in kernel.SELF_CHECKS.items()} == \
        {"swa": True, "sa rank": True, "sa value": True}
    assert A.engine_line("cpu", torch.float32, 16, ["full", "moba"]) == "attention: no SWA or SA on cpu"


def inject(monkeypatch, fault, dtype=None, per_head=False):
    """One fault in the kernel, for dtype only if given, and only with one perm per head if per_head: the band one key
    too wide, a wrong scale (both forward and backward), dk or dq 10% off (backward only), or a NaN in the output
    (forward only). Injected below the ops, so that the self-check, which calls what they call (kernel._forward,
    kernel._backward), meets the fault as a call does."""
    launch, backward, forward = kernel._launch, kernel._backward, kernel._attn_fwd
    hit = lambda q, perm=None: (dtype is None or q.dtype == dtype) and (  # noqa: E731
        not per_head or perm is not None and perm.dim() == 3)

    def wide(q, k, v, o, perm, r, width, *a):
        return launch(q, k, v, o, perm, r, width + (1 if r is None else 1 / q.shape[2]) * hit(q, perm), *a)

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
        monkeypatch.setattr(*{"window": (kernel, "_launch", wide), "nan": (kernel, "_attn_fwd", NanRow()),
                              "dq": (kernel, "_backward", off(0)), "dk": (kernel, "_backward", off(1))}[fault])


@pytest.mark.parametrize("fault, kind", [("window", "swa"), ("scale", "sa"), ("dk", "sa-value"), ("dq", "swa"),
                                         ("nan", "sa")])
def test_the_self_check_catches_a_faulty_kernel(monkeypatch, fault, kind):
    """Under "triton" the first call raises, naming the device, dtype, kernel rule and error; under "auto" (here the
    interpreter plays a GPU) one warning says so and the torch engine gives the reference's output and gradients,
    which the faulty kernel, unchecked, does not."""
    fast, ref = attention_kinds(100, B=1, H=2)[kind]
    q, k, v = qkv(1, 2, 100, 16, device=KDEV)
    inject(monkeypatch, fault)
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    rule = {"swa": "swa", "sa": "sa rank", "sa-value": "sa value"}[kind]
    message = f"failed its self-check on the CPU interpreter float32 for {rule} .*against the dense fp32 reference"
    with pytest.raises(kernel.Unsupported, match=message):
        fast(q, k, v)
    play_a_gpu(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # as a user's Python: a warning once per place and text
        assert_same(fast, q, k, v, ref)
        fast(q, k, v)
    failures = [str(w.message) for w in caught if "self-check" in str(w.message)]
    assert len(failures) == 1 and re.search("torch engine instead: Unsupported: the Triton kernel " + message,
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
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
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
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    perm = random_perm((), 50, device=KDEV)
    for _ in range(3):
        A.sliding_window_attention(q, k, v, 8)
    for _ in range(2):
        A.stochastic_attention(q, k, v, 8, perm)
    assert calls == [(torch.float32, 16, "swa"), (torch.float32, 16, "sa rank")]


@pytest.mark.parametrize("faulty", [torch.bfloat16, torch.float32])
def test_a_failed_dtype_leaves_the_other_alone(monkeypatch, bf16_dot, plays_a_gpu, faulty):
    """A kernel wrong in one dtype only: that dtype warns and takes the torch engine, the other keeps the kernel."""
    inject(monkeypatch, "window", faulty)
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    with pytest.warns(UserWarning, match=f"self-check on the CPU interpreter {str(faulty)[6:]} for swa"):
        for dtype in (torch.bfloat16, torch.float32):
            A.sliding_window_attention(q.to(dtype), k.to(dtype), v.to(dtype), 8)
    assert {case[1]: err <= kernel.TOLERANCE[case[1]] for case, err in kernel.SELF_CHECKS.items()} == \
        {torch.bfloat16: faulty != torch.bfloat16, torch.float32: faulty != torch.float32}
    for dtype in (torch.bfloat16, torch.float32):
        line = A.engine_line("cpu", dtype, 16, ["swa"])
        failed = f"attention: the torch engine for swa on the CPU interpreter {str(dtype)[6:]}: Unsupported: the Triton"
        assert line.startswith(failed + " kernel failed" if dtype == faulty else "attention: Triton kernel"), line


def test_triton_swa_two_sided_band_one_short_of_a_key_tile(small_blocks):
    """A two-sided band (SA's) whose right edge, start + window - 1, ends one key before a key tile starts (window 31,
    tiles of 16 and 32): the interior region, run without the band mask, must stop a tile short."""
    q, k, v, perm = kernel_case(1, 2, 100, 16, torch.float32, "perm")
    assert_same(lambda *x: kernel.triton_swa(*x, 31, perm), q, k, v, reference(31, perm))


def test_value_sa_through_triton_hides_keys_at_exactly_delta(small_blocks, monkeypatch):
    """r multiples of 1/64, delta = 1/8: pairs at exactly delta in fp32, which the kernel's strict < hides."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    T, delta = 64, 0.125
    r = random_perm((), T, device=KDEV).float() / T
    q, k, v = qkv(1, 2, T, 16, device=KDEV)
    assert_same(lambda *x: A.stochastic_value_attention(*x, delta, r), q, k, v,
                lambda *x: A.sa_value_reference(*x, delta, r))


def test_the_kernels_value_spans_keep_keys_at_the_edge_of_delta(small_blocks):
    """The kernel finds each tile's key span by bisection of r, reaching VALUE_MARGIN past delta: with pairs at delta,
    give or take an fp32 ulp (the earlier token's r the greater), it keeps exactly the rule's pairs; without the margin
    a tile loses one (seeds 16 and 58, at these tiles; most seeds lose none: a tile's last step reads past its span)."""
    T, delta = 200, 0.1
    q, k, v = (t.detach() for t in qkv(1, 1, T, 16, device=KDEV))
    lost = {}
    for margin in (A.VALUE_MARGIN, 0.0):
        lost[margin] = []
        for seed in (0, 16, 58):
            r, perm = edge_pairs(T, delta, seed).flip(0).to(KDEV).sort()
            got, want = kernel.triton_swa(q, k, v, delta, perm, r, margin), kernel.dense(q, k, v, delta, perm, r)
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                lost[margin].append(seed)
    assert lost[A.VALUE_MARGIN] == [] and lost[0.0], lost


@pytest.mark.parametrize("rule, kind", [("sa rank", "sa-bht"), ("sa value", "sa-value-bht")])
def test_the_self_check_covers_per_head_permutations(monkeypatch, rule, kind):
    """A kernel wrong only where each head has its own permutation (sa_draw="head", the class demo's): the self-check
    runs that case too (it ran one shared permutation only), so "triton" refuses it at the first call."""
    inject(monkeypatch, "window", per_head=True)
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    fast, ref = attention_kinds(100, B=1, H=2)[kind]
    with pytest.raises(kernel.Unsupported, match=f"failed its self-check on the CPU interpreter float32 for {rule}"):
        fast(*qkv(1, 2, 100, 16, device=KDEV))


# -----------------------------------------------------------------------------
# The self-check runs the binary training runs (issue 62): Triton specialises T on its divisibility by 16, training's
# T is a multiple of 16, and at training's tiles (bf16's at head dim 64: BIG) a window of 100 left no interior tile.

BIG = kernel.Tiling(128, 64, 128, 32, num_warps=8, num_stages=3, precision=None, min_shared_kb=0)
OLD_CHECK = dict(T=300, window=100, B=1)  # 13a6b5a's self-check: T = 300, window 100, B = 1 (H = 2)
CPU = torch.device("cpu")


def every_tiling():
    """Every tiling choose_tiling gives, any dtype, head dim and GPU (CUDA or AMD's), and the tests' SMALL."""
    targets = (kernel.INTERPRETER, kernel.Target("hip", "gfx942", 64 * 1024))
    return list(dict.fromkeys([kernel.choose_tiling(dtype, D, target)._replace(min_shared_kb=0) for target in targets
                               for dtype in PTR for D in kernel.HEAD_DIMS] + [SMALL]))


def test_the_self_check_runs_trainings_specialisation():
    """Its T is a multiple of 16 (as a block_size is) and of no tile larger, so that its last tile is cut."""
    for tiling in every_tiling():
        T, window = kernel.check_size(tiling)
        assert T % 16 == 0 and T % 32 and window < T, (tiling, T, window)


@triton.jit
def _spans_of(Spans, T, before, after, TILE_FIXED: tl.constexpr, TILE_LOOP: tl.constexpr):
    """Each program's span of kernel._span, the band's (no r): (lo, mid_lo, mid_hi, hi) at Spans[4 * program]."""
    lo, mid_lo, mid_hi, hi = kernel._span(tl.program_id(0) * TILE_FIXED, TILE_FIXED, TILE_LOOP, before, after, T, Spans,
                                          Spans, 0.0, 0.0, False, False)
    at = Spans + 4 * tl.program_id(0)
    tl.store(at, lo), tl.store(at + 1, mid_lo), tl.store(at + 2, mid_hi), tl.store(at + 3, hi)


def test_the_self_checks_size_meets_every_region_of_every_tiling():
    """At check_size's T and window, for every tiling choose_tiling gives, some program of each loop (forward; the
    backward's dK, dV and dQ) meets a left edge, an interior (run unmasked) and a right edge, for SWA and SA's rank
    rule (the value rule has no interior: all its tiles are masked)."""
    for tiling in every_tiling():
        T, window = kernel.check_size(tiling)
        for rule, (left, right) in (("swa", (window - 1, 0)), ("sa rank", (window - 1, window - 1))):
            for loop, tiles, before, after in (("forward", tiling[:2], left, right),
                                               ("dK, dV", tiling[2:4], right, left), ("dQ", tiling[2:4], left, right)):
                spans = torch.zeros(triton.cdiv(T, tiles[0]), 4, dtype=torch.int32)
                _spans_of[(len(spans),)](spans, T, before, after, TILE_FIXED=tiles[0], TILE_LOOP=tiles[1])
                met = [(spans[:, i] < spans[:, i + 1]).any().item() for i in range(3)]
                assert met == [True] * 3, (tiling, rule, loop, spans.tolist())


def faulty_interior(monkeypatch, loop):
    """kernel's `loop` adds 1 to its first result where it runs interior tiles, and only there."""
    inner = getattr(kernel, loop)
    params = list(inspect.signature(inner.fn).parameters)

    def faulty(*args):
        got, a = inner(*args), dict(zip(params, args))
        if a["EDGE"] or not a["hi"] > a["lo"]:
            return got
        return got + 1 if loop == "_bwd_dq_inner" else (got[0] + 1, *got[1:])
    monkeypatch.setattr(kernel, loop, faulty)


@pytest.mark.parametrize("loop", ["_fwd_inner", "_bwd_dq_inner"])
def test_the_self_check_catches_a_fault_in_interior_tiles_only(monkeypatch, loop):
    """A kernel wrong only in its interior tiles (no band mask, no bounds checks), forward or backward, at training's
    tiles: the self-check catches it; with 13a6b5a's sizes it ran no interior tile there, and passed it."""
    monkeypatch.setattr(kernel, "choose_tiling", lambda *a: BIG)
    faulty_interior(monkeypatch, loop)
    tolerance = kernel.TOLERANCE[torch.float32]
    assert kernel.self_check(CPU, torch.float32, 16, "swa") > tolerance
    assert kernel.self_check(CPU, torch.float32, 16, "swa", **OLD_CHECK) <= tolerance


def test_the_self_check_catches_a_fault_in_the_binary_of_t_divisible_by_16_only(monkeypatch):
    """A kernel wrong only where T is a multiple of 16, training's specialisation (here: a band one key too wide): the
    self-check catches it; 13a6b5a's (T = 300) passed it."""
    launch = kernel._launch

    def wide(q, k, v, o, perm, r, width, *a):
        return launch(q, k, v, o, perm, r, width + (q.shape[2] % 16 == 0), *a)
    monkeypatch.setattr(kernel, "_launch", wide)
    tolerance = kernel.TOLERANCE[torch.float32]
    assert kernel.self_check(CPU, torch.float32, 16, "swa") > tolerance
    assert kernel.self_check(CPU, torch.float32, 16, "swa", **OLD_CHECK) <= tolerance


def test_the_grid_folds_batch_and_heads_into_one_dimension(monkeypatch):
    """A CUDA grid's y dimension stops at 65,535: every launch's grid is 1-D, B * H * tiles programs (tiles fastest),
    here at B * H = 70,000."""
    grids = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: grids.append(grid)
    for name in ("_attn_fwd", "_attn_bwd", "_rowdot"):
        monkeypatch.setattr(kernel, name, Stub())
    monkeypatch.setattr(kernel, "SELF_CHECK", False)
    q = torch.zeros(2, 35000, 1, 16, requires_grad=True)
    torch.autograd.grad(kernel.triton_swa(q, q, q, 4).sum(), q)
    assert grids == [(70000,)] * 3


def test_a_perm_that_is_no_permutation_is_refused_eagerly(monkeypatch):
    """A compiled call assumes a valid perm (its interior tiles load unmasked; triton_swa's docstring says what it
    assumes): eagerly attention.py refuses one that is not, before the kernel runs."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    q, k, v = qkv(1, 2, 40, 16, device=KDEV)
    for bad in (torch.zeros(40, dtype=torch.long), torch.arange(40) + 1, torch.arange(40).expand(1, 2, 40) - 1):
        with pytest.raises(ValueError, match="perm must be a permutation"):
            A.stochastic_attention(q, k, v, 8, bad.to(KDEV))


def test_tuned_tilings_are_chosen_by_length_and_each_self_checked(monkeypatch):
    """kernel.TUNED (a GPU run's picks): a call runs the first tiling whose longest T reaches its own, else
    choose_tiling's; the self-check checks every tiling a call may run."""
    tuned, default = SMALL._replace(one_loop=True), kernel.choose_tiling(torch.float32, 16, kernel.INTERPRETER)
    monkeypatch.setitem(kernel.TUNED, ("cuda", 80, torch.float32, 16), ((64, tuned),))
    assert kernel.tilings(torch.float32, 16, kernel.INTERPRETER) == [default, tuned]
    assert [kernel.tiling_for(torch.float32, 16, kernel.INTERPRETER, T) for T in (64, 65)] == [tuned, default]
    ran, forward = [], kernel._forward
    monkeypatch.setattr(kernel, "_forward", lambda *a: ran.append(a[-1]) or forward(*a))
    assert kernel.self_check(CPU, torch.float32, 16, "swa") < 1e-4 and ran == [default, tuned]
    monkeypatch.setattr(kernel, "SELF_CHECK", False)  # run just now
    q, k, v = qkv(1, 2, 50, 16, device=KDEV)
    assert_same(lambda *x: kernel.triton_swa(*x, 8), q, k, v, reference(8, None))
    assert ran[-1] == tuned


# Kernel variants for a GPU run to choose (kernel.Tiling's switches; gpu_check's sweep times each)

@pytest.mark.parametrize("variant, rule", [("one_loop", "swa"), ("one_loop", "sa rank"), ("dq_atomic", "swa"),
                                           ("dq_atomic", "sa rank"), ("dq_atomic", "sa value"),
                                           ("spans_first", "sa value")])
def test_each_variant_equals_the_dense_reference(monkeypatch, variant, rule):
    """Each variant against the dense fp32 rule, out and gradients, at T = 100 and window 33 (no multiple of a tile,
    edge and interior tiles), SA's rules with one permutation and with one per head (self_check's cases)."""
    monkeypatch.setattr(kernel, "choose_tiling", lambda *a: SMALL._replace(**{variant: True}))
    assert kernel.self_check(CPU, torch.float32, 16, rule, T=100, window=33) < 1e-4


# One line for every refusal on the kernel path

REFUSALS = [("--D=abc", "--D=abc: use a head dim with a kernel: 16, 32, 64, 128"),
            ("--D=8", "--D=8: use a head dim with a kernel"), ("--check_T=0", "--check_T=0: use lengths >= 1"),
            ("--B=0", "--B=0: use a whole number >= 1"), ("--check_windows=0", "--check_windows=0: use windows >= 1"),
            ("--check_windows=-5", "--check_windows=-5: use windows >= 1"),
            ("--dtypes=bfloat16", "--dtypes=bfloat16: the interpreter's bf16 tl.dot is wrong")]


@pytest.mark.skipif(KDEV == "cuda", reason="the interpreter's refusals")
def test_kernel_check_refuses_each_bad_setting_in_one_line():
    """`python kernel.py --check` with a bad setting: one line that names it (they once ended in a ValueError,
    ZeroDivisionError or RuntimeError traceback, or blamed an invalid window on the kernel)."""
    runs = {arg: subprocess.Popen([sys.executable, "kernel.py", "--check", arg], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
            for arg, _ in REFUSALS}
    for arg, message in REFUSALS:
        lines = runs[arg].communicate(timeout=300)[0].splitlines()
        assert runs[arg].returncode == 1 and len(lines) == 1 and lines[0].startswith(f"kernel.py: {message}"), lines


def test_check_once_refuses_in_one_line(monkeypatch):
    """A head dim without a kernel (8: n_embd 32 at n_head 4) names the setting; on the interpreter, bf16 fails its
    self-check and says why: the interpreter's bf16 dot, not the kernel."""
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    with pytest.raises(kernel.Unsupported) as e:
        kernel.check_once(CPU, torch.float32, 8, "swa")
    assert "\n" not in str(e.value) and "not head dim 8" in str(e.value) and "n_embd / n_head" in str(e.value)
    if KDEV == "cpu":
        with pytest.raises(kernel.Unsupported) as e:
            kernel.check_once(CPU, torch.bfloat16, 16, "swa")
        assert "\n" not in str(e.value) and "bf16 tl.dot is wrong (triton-lang/triton#11584)" in str(e.value)


# -----------------------------------------------------------------------------
# The hot code (issue 55): no host-device sync, few ops. Counted as dispatched, with the kernels' launches stubbed
# (the interpreter's own work is no GPU's). On a GPU, each sync stops the CPU from running ahead of it.

SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")


class Dispatched(TorchDispatchMode):
    """The aten ops dispatched under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def stubbed_launches(monkeypatch):
    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: None
    for name in ("_attn_fwd", "_attn_bwd", "_rowdot"):
        monkeypatch.setattr(kernel, name, Stub())
    monkeypatch.setattr(kernel, "SELF_CHECK", False)
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")


def test_an_sa_forward_dispatches_two_ops_and_no_sync(stubbed_launches):
    """One SA forward on the kernel, q, k, v as the model makes them (views of one (B, T, 3C) tensor, no copies): the
    output and the log-sum-exp allocated, and nothing else, for both rules and SWA (the value rule sorts r first). A
    permutation is checked once (a sync), where it is drawn or at its first call; then never again."""
    B, T, H, D = 2, 100, 3, 16
    q, k, v = torch.randn(B, T, 3 * H * D).split(H * D, dim=2)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D) each, strided
    perm, r = random_perm((), T), checked(torch.rand(T))
    first, calls = Dispatched(), {}
    with first:
        A.stochastic_attention(q, k, v, 8, perm)
    assert sum(first.ops.count(op) for op in SYNCS) == 1  # perm's check
    for name, fn in (("sa", lambda: A.stochastic_attention(q, k, v, 8, perm)),
                     ("sa value", lambda: A.stochastic_value_attention(q, k, v, 0.1, r)),
                     ("swa", lambda: A.sliding_window_attention(q, k, v, 8))):
        with Dispatched() as mode:
            fn()
        calls[name] = mode.ops
    assert calls == {"sa": ["aten.empty_strided", "aten.new_empty"], "swa": ["aten.empty_strided", "aten.new_empty"],
                     "sa value": ["aten.sort", "aten.empty_strided", "aten.new_empty"]}, calls


def test_a_gpt_step_makes_no_sync(stubbed_launches):
    """A forward and backward of a small SA+SWA GPT (both SA rules; one permutation per head too) on the kernel reads
    no value back to the host: its SA draws are made valid (checked at the draw) and copied without waiting, and its
    tokens are checked on the CPU only (a GPU's embedding asserts on its own)."""
    x = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    for sa_rule, sa_draw in (("rank", "layer"), ("value", "layer"), ("rank", "head")):
        model = tiny("sa+swa", sa_draw=sa_draw, sa_rule=sa_rule)
        with Dispatched() as mode:
            model(x[:, :-1], x[:, 1:])[1].backward()
        assert not [op for op in mode.ops if op in SYNCS], (sa_rule, sa_draw)
