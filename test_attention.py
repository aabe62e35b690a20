"""Tests for attention.py and model.py (kernel.py's are in tests/test_kernel.py). Run: python -m pytest -q"""
import inspect
import itertools
import math
import os
import sys

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

import attention as A
import moba
import model as M
from model import GPT, GPTConfig

TS = [1, 7, 100, 257]  # sequence lengths that are not multiples of any tile size


def qkv(B, H, T, D, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]


def random_perm(shape, T, seed=1, device="cpu"):
    """A random permutation of range(T) for every index of shape: () gives (T,), (B, H) gives (B, H, T)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, T, generator=g).argsort(-1).to(device)


def out_and_grads(fn, q, k, v, seed=2):
    out = fn(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [out, *grads]


def assert_same(fast, q, k, v, ref, ref_dtype=torch.float32):
    """fast(q, k, v) equals the reference on the same (rounded) inputs: forward and dq, dk, dv;
    tight in fp32, loose in half precision."""
    dtype = q.dtype
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=5e-2)
    qr, kr, vr = (t.detach().to(ref_dtype).requires_grad_() for t in (q, k, v))
    for name, got, want in zip(("out", "dq", "dk", "dv"), out_and_grads(fast, q, k, v), out_and_grads(ref, qr, kr, vr)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"{name}: {m}")


# -----------------------------------------------------------------------------
# The fast functions agree with the dense-mask references, forward and backward.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("window", [1, 5, 64, 300])
def test_swa_fast_equals_reference(T, window, dtype):
    q, k, v = qkv(2, 3, T, 16, dtype=dtype)
    assert_same(lambda q, k, v: A.sliding_window_attention(q, k, v, window), q, k, v,
                lambda q, k, v: A.swa_reference(q, k, v, window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("perm_shape", [(), (2, 3)])
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("window", [1, 5, 64, 300])
def test_sa_fast_equals_reference(T, window, perm_shape, dtype):
    """The gather -> SWA(pos=perm) -> scatter route against SA's mask written directly in token order."""
    q, k, v = qkv(2, 3, T, 16, dtype=dtype)
    perm = random_perm(perm_shape, T)
    assert_same(lambda q, k, v: A.stochastic_attention(q, k, v, window, perm), q, k, v,
                lambda q, k, v: A.sa_reference(q, k, v, window, perm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r_shape", [(), (2, 3), (1, 3)])
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("window", [1, 5, 64, 300])
def test_sa_value_fast_equals_reference(T, window, r_shape, dtype):
    """The value rule's per-tile key spans (sorted by r) against its mask written in token order."""
    q, k, v = qkv(2, 3, T, 16, dtype=dtype)
    r = torch.rand(*r_shape, T, generator=torch.Generator().manual_seed(1))
    assert_same(lambda q, k, v: A.stochastic_value_attention(q, k, v, window / T, r), q, k, v,
                lambda q, k, v: A.sa_value_reference(q, k, v, window / T, r))


def test_sa_value_spans_are_exact_at_the_edge_of_delta():
    """Keys whose r lies at delta from a query's, within a few fp32 ulps either side: the fast
    function's spans must keep exactly the pairs that the rule's |r_i - r_j| < delta keeps."""
    T, delta = 200, 0.1
    r, (q, k, v) = edge_pairs(T, delta, seed=3), qkv(1, 2, T, 8)
    assert_same(lambda q, k, v: A.stochastic_value_attention(q, k, v, delta, r), q, k, v,
                lambda q, k, v: A.sa_value_reference(q, k, v, delta, r))


def edge_pairs(T, delta, seed):
    """r (T,) with pairs at delta, give or take an fp32 ulp or so."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(T, generator=g)
    r[1::2] = r[::2] + delta + torch.randint(-3, 4, (T // 2,), generator=g) * 6e-8
    return r


def test_value_spans_hold_every_key_within_delta(monkeypatch):
    """attention.value_spans: each query tile's key span holds every key within delta of one of its queries, with
    pairs at delta give or take an ulp; without VALUE_MARGIN some tile loses one. (The torch engine pads every tile to
    the longest span, which hides most such losses; the kernel reads exact spans, by its own search.)"""
    T, delta, tile = 200, 0.1, 64
    first = torch.arange(0, T, tile)
    last = (first + tile).clamp(max=T) - 1
    missed, margins = {}, (A.VALUE_MARGIN, 0.0)
    for margin in margins:
        monkeypatch.setattr(A, "VALUE_MARGIN", margin)
        missed[margin] = []
        for seed in range(100):
            rs = edge_pairs(T, delta, seed).sort().values  # (T,): slots in r order
            lo, nk = A.value_spans(rs, delta, first, last)  # (ntiles,), the longest span
            hi = torch.searchsorted(rs, rs[last] + delta + margin).maximum(last + 1)  # each tile's own end
            sees = (rs[:, None] - rs[None, :]).abs() < delta  # (T, T): the rule, query slot i, key slot j
            t, j = torch.arange(T) // tile, torch.arange(T)
            inside = (lo[t, None] <= j) & (j < hi[t, None])  # (T, T): key j in query i's tile's span
            assert (hi - lo).max() == nk
            if (sees & ~inside).any():
                missed[margin].append(seed)
    assert missed[margins[0]] == [] and missed[0.0], missed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("moba_chunk,top_k", [(4, 1), (8, 3), (16, 2), (32, 100)])
def test_moba_fast_equals_reference(T, moba_chunk, top_k, dtype):
    q, k, v = qkv(2, 3, T, 16, dtype=dtype)
    # the reference runs in the same dtype: top-k routing is discontinuous, so
    # fp32 and bf16 chunk scores may legitimately pick different chunks
    assert_same(lambda q, k, v: A.moba_attention(q, k, v, moba_chunk, top_k), q, k, v,
                lambda q, k, v: A.moba_reference(q, k, v, moba_chunk, top_k), ref_dtype=dtype)


# -----------------------------------------------------------------------------
# The rules at their edges, checked against independent facts.

@pytest.mark.parametrize("T", TS)
def test_window_one_sees_only_itself(T):
    q, k, v = qkv(1, 2, T, 8)
    torch.testing.assert_close(A.sliding_window_attention(q, k, v, 1), v, atol=0, rtol=0)
    torch.testing.assert_close(A.stochastic_attention(q, k, v, 1, random_perm((), T)), v, atol=0, rtol=0)


@pytest.mark.parametrize("T", TS)
def test_large_budgets_equal_full_attention(T):
    q, k, v = qkv(2, 3, T, 16)
    full = A.full_attention(q, k, v)
    for window in (T, T + 5):
        torch.testing.assert_close(A.sliding_window_attention(q, k, v, window), full, atol=1e-5, rtol=1e-4)
        for shape in ((), (2, 3)):
            torch.testing.assert_close(A.stochastic_attention(q, k, v, window, random_perm(shape, T)), full,
                                       atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(A.moba_attention(q, k, v, 8, (T + 7) // 8), full, atol=1e-5, rtol=1e-4)


def test_readme_recipe_is_the_code():
    """README.md's SA recipe is stochastic_attention's body, character for character."""
    readme = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read()
    recipe = readme.split("the whole idea is")[1].split("```python\n")[1].split("```")[0].splitlines()
    body = inspect.getsource(A.stochastic_attention).splitlines()
    assert len(recipe) == 3 and [line[4:] for line in body[-3:]] == recipe


@pytest.mark.parametrize("T", TS)
def test_identity_permutation_is_swa(T):
    q, k, v = qkv(2, 3, T, 16)
    torch.testing.assert_close(A.stochastic_attention(q, k, v, 5, torch.arange(T)),
                               A.sliding_window_attention(q, k, v, 5), atol=1e-6, rtol=1e-5)


def test_masks_follow_the_written_rules():
    """swa_mask/sa_mask/sa_value_mask spelled out entry by entry, so the oracle itself is checked."""
    T, w = 9, 3
    perm, r = random_perm((), T), torch.rand(T, generator=torch.Generator().manual_seed(0))
    slot = {int(t): s for s, t in enumerate(perm)}
    swa, sa, slot_space = A.swa_mask(T, w), A.sa_mask(w, perm), A.swa_mask(T, w, pos=perm)
    value = A.sa_value_mask(0.2, r)
    for i in range(T):
        for j in range(T):
            assert swa[i, j] == (i - w < j <= i)
            assert sa[i, j] == (j <= i and abs(slot[i] - slot[j]) < w)
            assert slot_space[i, j] == (abs(i - j) < w and int(perm[j]) <= int(perm[i]))
            assert value[i, j] == (j <= i and abs(r[i].item() - r[j].item()) < 0.2)


def test_value_rule_is_prefix_consistent_and_rank_rule_is_not():
    """Why only the value rule can be decoded from a KV cache: under it the keys of query i do not
    change when tokens are appended; under the rank rule, slots of later tokens move them."""
    T, n, w = 64, 40, 6
    r = torch.rand(T, generator=torch.Generator().manual_seed(0))
    assert torch.equal(A.sa_value_mask(w / T, r)[:n, :n], A.sa_value_mask(w / T, r[:n]))
    perm = random_perm((), T)
    assert not torch.equal(A.sa_mask(w, perm)[:n, :n], A.sa_mask(w, perm[perm < n]))


def test_sa_sees_window_keys_on_average():
    """In permuted space a query sees ~`window` keys on average, like SWA: the budget is fair."""
    T, w = 4096, 32
    mask = A.sa_mask(w, random_perm((), T))
    assert abs(mask.sum(-1).float().mean().item() - w) < 0.05 * w
    assert mask.sum(-1).min() >= 1  # every query sees at least itself


# -----------------------------------------------------------------------------
# The fast functions are O(T * window): no T x T tensor is ever created.

class MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


@pytest.mark.parametrize("kind", ["swa", "sa", "moba"])
def test_fast_path_never_materialises_t_by_t(kind):
    T = 16384
    q, k, v = qkv(1, 1, T, 16)
    fn = {"swa": lambda: A.sliding_window_attention(q, k, v, 16),
          "sa": lambda: A.stochastic_attention(q, k, v, 16, random_perm((), T)),
          "moba": lambda: A.moba_attention(q, k, v, 16, 2)}[kind]  # routing scores alone would be T*T/16
    with MaxNumel() as seen:
        fn().sum().backward()
    assert seen.max < T * T // 16, f"{kind} created a tensor of {seen.max} elements (T*T = {T * T})"
    with MaxNumel() as dense:  # and the probe does catch the reference's T x T scores
        A.swa_reference(q[..., :1024, :], k[..., :1024, :], v[..., :1024, :], 16)
    assert dense.max >= 1024 * 1024


@pytest.mark.parametrize("moba_chunk", [300, 10**9])
def test_moba_memory_follows_t_not_the_block(moba_chunk):
    """A chunk of T keys or more is one chunk: full causal attention, in memory of T (its one chunk's T x T scores
    per head), not of moba_chunk (--moba_chunk=1000000000 used to allocate 128 GB)."""
    q, k, v = qkv(1, 2, 300, 8)
    with MaxNumel() as seen:
        out = A.moba_attention(q, k, v, moba_chunk, 4)
    assert seen.max <= 2 * 300 * 300
    torch.testing.assert_close(out, A.full_attention(q, k, v))
    torch.testing.assert_close(A.moba_reference(q, k, v, moba_chunk, 4), out)


def test_moba_memory_is_bounded_at_32k():
    """MoBA's fast function works in chunks: at T=32768, H=8, D=64 no op output is larger than about
    one input (64 MB in fp32), where gathering K/V per query tile needed 12 GB (192 inputs)."""
    T = 32768
    q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))
    with MaxNumel() as seen, torch.no_grad():
        A.moba_attention(q, k, v, 64, 4)
    assert seen.max < 1.01 * q.numel(), f"moba created a tensor of {seen.max} elements"


# -----------------------------------------------------------------------------
# Numerics: no kind produces NaN or inf where PyTorch's SDPA stays finite.

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("engine", ["torch", "dense"])
def test_finite_wherever_sdpa_is_finite(monkeypatch, engine, dtype):
    """q, k = 150 * randn at D=64: q.k reaches ~1e6, past fp16's 65504 when computed in fp16; SDPA
    scales first and stays finite. So must every kind, forward and gradients."""
    monkeypatch.setattr(A, "ATTN_ENGINE", engine)
    T, perm = 100, random_perm((), 100)
    kinds = {"full": A.full_attention, "swa": lambda q, k, v: A.sliding_window_attention(q, k, v, 16),
             "sa": lambda q, k, v: A.stochastic_attention(q, k, v, 16, perm),
             "moba": lambda q, k, v: A.moba_attention(q, k, v, 16, 3)}
    for scale in (1, 150):
        q, k, v = (x.detach() for x in qkv(1, 2, T, 64))
        q, k = (scale * x for x in (q, k))
        q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
        sdpa = out_and_grads(lambda *x: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True), q, k, v)
        for name, fn in kinds.items():
            for what, want, got in zip(("out", "dq", "dk", "dv"), sdpa, out_and_grads(fn, q, k, v)):
                assert got.isfinite().all() or not want.isfinite().all(), f"{name} {what} at scale {scale}"
    assert all(t.isfinite().all() for t in sdpa), "the inputs must keep SDPA finite, else the test is void"


def test_moba_routes_in_fp32():
    """bf16 inputs are routed by fp32 scores, as MoBA's own code does: the same chunks as for the
    same (rounded) values in fp32. Scoring in bf16 picks other chunks on some rows."""
    q, k = (x.detach().to(torch.bfloat16) for x in qkv(2, 4, 2048, 64)[:2])
    idx16, ok16 = moba.moba_select(q, k, 16, 4)
    idx32, ok32 = moba.moba_select(q.float(), k.float(), 16, 4)
    assert torch.equal(ok16, ok32)
    assert torch.equal(idx16.sort(-1).values, idx32.sort(-1).values)


def test_moba_mask_follows_its_rule_by_brute_force():
    """moba_mask, row by row from the paper's rule: query i sees j <= i in its own chunk, and every key of the
    top_k - 1 strictly-past chunks whose mean key scores highest against q_i (the reference and the fast function share
    moba_select, so only this test states how many chunks it picks)."""
    B, H, T, D, chunk, top_k = 1, 2, 45, 8, 4, 3
    q, k = qkv(B, H, T, D)[:2]
    got = A.moba_mask(q, k, chunk, top_k)  # (B, H, T, T)
    want = torch.zeros(B, H, T, T, dtype=torch.bool)
    for h, i in itertools.product(range(H), range(T)):
        own = i // chunk
        want[0, h, i, own * chunk:i + 1] = True
        if own:
            means = k[0, h, :own * chunk].view(own, chunk, D).mean(1)  # (own, D): each past chunk's mean key
            for c in (means @ q[0, h, i]).topk(min(top_k - 1, own)).indices.tolist():
                want[0, h, i, c * chunk:(c + 1) * chunk] = True
    assert torch.equal(got, want)


def attention_kinds(T, window=16, B=2, H=3):
    """Every kind as a function of (q, k, v), with its dense reference: {name: (fast, reference)}."""
    perm, perm_bht = random_perm((), T), random_perm((B, H), T)
    r, r_bht = (torch.rand(*shape, T, generator=torch.Generator().manual_seed(4)) for shape in ((), (B, H)))
    return {"full": (A.full_attention, lambda q, k, v: A.masked_attention(q, k, v, A.swa_mask(T, max(T, 1)))),
            "swa": (lambda q, k, v: A.sliding_window_attention(q, k, v, window),
                    lambda q, k, v: A.swa_reference(q, k, v, window)),
            "sa": (lambda q, k, v: A.stochastic_attention(q, k, v, window, perm),
                   lambda q, k, v: A.sa_reference(q, k, v, window, perm)),
            "sa-bht": (lambda q, k, v: A.stochastic_attention(q, k, v, window, perm_bht),
                       lambda q, k, v: A.sa_reference(q, k, v, window, perm_bht)),
            "sa-value": (lambda q, k, v: A.stochastic_value_attention(q, k, v, window / max(T, 1), r),
                         lambda q, k, v: A.sa_value_reference(q, k, v, window / max(T, 1), r)),
            "sa-value-bht": (lambda q, k, v: A.stochastic_value_attention(q, k, v, window / max(T, 1), r_bht),
                             lambda q, k, v: A.sa_value_reference(q, k, v, window / max(T, 1), r_bht)),
            "moba": (lambda q, k, v: A.moba_attention(q, k, v, 16, 3),
                     lambda q, k, v: A.moba_reference(q, k, v, 16, 3))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["full", "swa", "sa", "sa-bht", "sa-value", "moba"])
def test_every_kind_runs_under_autocast(kind, dtype):
    """fp32 inputs under torch.autocast: forward and backward run, the output has SDPA's dtype
    under the same autocast, and the fast function equals its reference (under autocast too)."""
    T = 100
    fast, ref = attention_kinds(T)[kind]
    q, k, v = qkv(2, 3, T, 16)
    with torch.autocast("cpu", dtype=dtype):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        got, want = out_and_grads(fast, q, k, v), out_and_grads(ref, q, k, v)
    assert got[0].dtype == sdpa.dtype == dtype and all(g.dtype == torch.float32 for g in got[1:])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b.float(), atol=6e-2, rtol=5e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("attn,sa_rule", [(a, "rank") for a in ["full", "swa", "sa", "sa+swa", "moba"]] +
                         [("sa", "value")])
def test_model_trains_under_autocast(attn, sa_rule):
    """The reproduction of issue 21: a GPT forward and backward under bf16 autocast, for every kind."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=64, window=8, moba_chunk=8,
                          moba_topk=2, attn=attn, sa_rule=sa_rule))
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    assert loss.isfinite() and all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("tile", [1, 7, 1 << 30])
@pytest.mark.parametrize("kind", ["swa", "sa", "sa-bht", "sa-value", "moba"])
def test_any_tile_size_equals_reference(monkeypatch, kind, tile):
    """The torch engine's query tiles of one row, of 7 (no divisor of T = 300) or of all T at once, and MoBA's calls
    of one group or of every group at once: equal too."""
    monkeypatch.setattr(A, "TILE", tile)
    monkeypatch.setattr(moba, "CALL", tile)
    fast, ref = attention_kinds(300)[kind]
    assert_same(fast, *qkv(2, 3, 300, 16), ref)


@pytest.mark.parametrize("kind", ["swa", "sa", "sa-bht", "sa-value", "moba"])
def test_a_nan_key_reaches_only_the_queries_that_see_it(kind):
    """A NaN in key 200 makes NaN exactly the rows whose rule sees key 200, as in the reference:
    a hidden key's NaN must never leak (0 * NaN) into an earlier query, or any query that hides it."""
    T = 256
    fast, ref = attention_kinds(T, window=4, B=1, H=2)[kind]
    q, k, v = (t.detach() for t in qkv(1, 2, T, 16))
    k[:, :, 200] = float("nan")
    want = ref(q, k, v).isnan().any(-1)                                  # (B, H, T): the rows that see key 200
    assert want.any() and not want[..., :200].any()
    assert torch.equal(fast(q, k, v).isnan().any(-1), want)


def assert_a_bad_value_reaches_only_its_queries(fast, ref, T, device="cpu"):
    """A NaN or inf in v[j, d] (j the first, a middle and the last key; every other d) makes out[i, d] non-finite
    exactly where query i sees key j, in fast and ref, as SDPA would if it hid the keys it masks (0 * NaN = NaN):
    i sees j where the reference moves with v[j]. The gradients of the other rows stay finite."""
    q, k, v = qkv(1, 2, T, 16, device=device)
    for j in (0, T // 2, T - 1):
        moved = v.detach().clone()
        moved[:, :, j] += 1e4
        with torch.no_grad():
            sees = (ref(q, k, moved) != ref(q, k, v)).any(-1)               # (B, H, T): the queries that see key j
        assert sees[..., j].all() and not sees[..., :j].any()
        for bad in (float("nan"), float("inf")):
            vb = v.detach().clone()
            vb[:, :, j, ::2] = bad
            vb.requires_grad_()
            for fn in (fast, ref):
                out = fn(q, k, vb)
                assert torch.equal(~out.isfinite(), sees[..., None] & ~vb[:, :, j, None].isfinite()), (j, bad)
                out.masked_fill(sees[..., None], 0).sum().backward()
                assert all(t.grad.isfinite().all() for t in (q, k, vb)), (j, bad)
                q.grad = k.grad = vb.grad = None


@pytest.mark.parametrize("kind", ["full", "swa", "sa", "sa-bht", "sa-value", "moba"])
def test_a_bad_value_reaches_only_the_queries_that_see_it(kind):
    assert_a_bad_value_reaches_only_its_queries(*attention_kinds(300, window=4, B=1, H=2)[kind], 300)


@pytest.mark.parametrize("shape", [(1, 2, 0, 8), (0, 2, 10, 8), (1, 0, 10, 8), (1, 2, 10, 0)], ids=["T", "B", "H", "D"])
def test_an_empty_dimension_gives_sdpa_s_empty_output(shape):
    """B, H, T or D of 0: the empty output and gradients that SDPA gives, from every kind and reference
    (B, H or D of 0 used to end in `cannot reshape tensor of 0 elements`, MoBA's in ZeroDivisionError)."""
    import torch.nn.functional as F
    q, k, v = qkv(*shape)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, fns in attention_kinds(shape[2], B=max(shape[0], 1), H=max(shape[1], 1)).items():
        for fn in fns:
            got = fn(q, k, v)
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert [g.shape for g in torch.autograd.grad(got.sum(), (q, k, v), allow_unused=True)] == [q.shape] * 3


def test_mixed_dtypes_raise_as_sdpa_does():
    """float32 q with float64 k used to run in float32 for SWA, SA and MoBA (full attention raised in SDPA);
    under autocast all three take the autocast dtype, as SDPA's."""
    q, k, v = qkv(1, 2, 10, 8)
    for name, fns in attention_kinds(10, B=1, H=2).items():
        for fn in fns:
            for args in ((q, k.double(), v), (q, k, v.half()), (q.double(), k, v)):
                with pytest.raises(ValueError, match="q, k, v must have one dtype, got"):
                    fn(*args)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert fn(q, k.double(), v).dtype == torch.bfloat16, name


# -----------------------------------------------------------------------------
# Bad input gets a clear error.

def test_bad_inputs_raise_clear_errors(monkeypatch):
    q, k, v = qkv(1, 2, 10, 8)
    with pytest.raises(ValueError, match="window"):
        A.sliding_window_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="perm"):
        A.stochastic_attention(q, k, v, 4, torch.arange(9))
    with pytest.raises(ValueError, match="perm"):
        A.stochastic_attention(q, k, v, 4, torch.arange(10).float())
    for r, problem in ((torch.arange(10), "r must be a float"), (torch.rand(3, 2, 10), "broadcastable to"),
                       (torch.rand(10), "delta")):
        with pytest.raises(ValueError, match=problem):
            A.stochastic_value_attention(q, k, v, 0.0 if problem == "delta" else 0.2, r)
    with pytest.raises(ValueError, match="moba_topk"):
        A.moba_attention(q, k, v, 4, 0)
    for perm in (torch.zeros(10, dtype=torch.long), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 8]),
                 torch.tensor([-1, 1, 2, 3, 4, 5, 6, 7, 8, 9]), torch.tensor([10, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
                 torch.stack([torch.arange(10), torch.arange(10).flip(0) % 9])[None]):  # (1, 2, T): one bad head
        with pytest.raises(ValueError, match="perm must be a permutation"):
            A.stochastic_attention(q, k, v, 4, perm)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="r must be finite"):
            A.stochastic_value_attention(q, k, v, 0.2, torch.rand(10).index_fill(0, torch.tensor([3]), bad))
    for shapes in (((1, 2, 10, 8), (1, 2, 10, 8), (1, 2, 9, 8)), ((1, 2, 10, 8), (1, 2, 9, 8), (1, 2, 9, 8)),
                   ((1, 2, 10, 8), (1, 3, 10, 8), (1, 3, 10, 8)), ((2, 10, 8),) * 3):
        for fn in (lambda *x: A.sliding_window_attention(*x, 4), lambda *x: A.moba_attention(*x, 4, 2),
                   lambda *x: A.stochastic_attention(*x, 4, torch.arange(10))):
            with pytest.raises(ValueError, match="q, k, v must be"):
                fn(*(torch.zeros(s) for s in shapes))
    for perm, problem in ((list(range(10)), "perm must be a LongTensor of shape .* got \\[0, 1"), (None, "got None"),
                          (torch.arange(10, device="meta"), "perm must be on q's device cpu, got meta")):
        with pytest.raises(ValueError, match=problem):
            A.stochastic_attention(q, k, v, 4, perm)
    with pytest.raises(ValueError, match="r must be a float tensor of shape .* got a list"):
        A.stochastic_value_attention(q, k, v, 0.2, [0.5] * 10)
    with pytest.raises(ValueError, match="q, k, v must be tensors, got list"):
        A.sliding_window_attention(q.tolist(), k, v, 4)
    monkeypatch.setattr(A, "ATTN_ENGINE", "cuda-magic")
    with pytest.raises(ValueError, match="ATTN_ENGINE"):
        A.sliding_window_attention(q, k, v, 4)


def test_the_references_check_their_arguments_as_the_fast_paths_do():
    """The dense references used to answer window 0, a perm that is no permutation, delta 0 or MoBA's chunk 0
    (silently, or with ZeroDivisionError); SWA's pos of the wrong length was a RuntimeError in tiled.py; a delta
    that fp32 rounds to 0 hid every key, even the query's own."""
    q, k, v = qkv(1, 2, 8, 4)
    perm, r = torch.randperm(8), torch.rand(8)
    for fn, problem in ((lambda: A.swa_reference(q, k, v, 0), "window must be an integer >= 1"),
                        (lambda: A.sa_reference(q, k, v, 0, perm), "window must be an integer >= 1"),
                        (lambda: A.sa_reference(q, k, v, 4, torch.zeros(8, dtype=torch.long)), "perm must be a perm"),
                        (lambda: A.sa_value_reference(q, k, v, 0, r), "delta must be a number >= 1.2e-38"),
                        (lambda: A.stochastic_value_attention(q, k, v, 1e-300, r), "delta must be a number"),
                        (lambda: A.stochastic_value_attention(q, k, v, True, r), "delta must be a number"),
                        (lambda: A.stochastic_value_attention(q, k, v, "0.1", r), "delta must be a number"),
                        (lambda: A.moba_reference(q, k, v, 0, 2), "moba_chunk must be an integer >= 1"),
                        (lambda: A.moba_reference(q, k, v, 4, 0), "moba_topk must be an integer >= 1"),
                        (lambda: A.sliding_window_attention(q, k, v, 4, pos=torch.arange(7)), "pos must be a Long"),
                        (lambda: A.swa_reference(q, k, v, 4, torch.arange(8.0)), "pos must be a LongTensor")):
        with pytest.raises(ValueError, match=problem):
            fn()
    tiny_delta = torch.finfo(torch.float32).tiny   # the smallest accepted: every query sees exactly itself
    torch.testing.assert_close(A.stochastic_value_attention(q, k, v, tiny_delta, r), v)
    torch.testing.assert_close(A.sa_value_reference(q, k, v, tiny_delta, r), v)
    torch.testing.assert_close(A.stochastic_value_attention(q, k, v, math.inf, r), A.full_attention(q, k, v))
    for bad in (math.nan, -1.0):
        with pytest.raises(ValueError, match="delta must be a number"):
            A.sa_value_mask(bad, r)
    with pytest.raises(ValueError, match="window must be an integer >= 1, got -1"):  # a mask of no key, even its own
        A.sa_mask(-1, perm)
    assert A.engine_line("cpu", torch.float32, 8, "swa") == "attention: the torch engine on cpu"  # a str, one kind


def test_the_triton_engine_on_a_cpu_says_why_in_one_line(monkeypatch):
    """--attn_engine=triton on a CPU used to end in ModuleNotFoundError (no triton) or `0 active drivers`."""
    q, k, v = qkv(1, 2, 10, 8)
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs the Triton kernel on a CUDA GPU, not on cpu .* use attn_engine 'auto'"):
        A.sliding_window_attention(q, k, v, 4)
    with pytest.raises(ValueError, match="runs the Triton kernel on a CUDA GPU"):
        A.engine_line("cpu", torch.float32, 8, ["sa+swa"])
    monkeypatch.setattr(A.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="needs the triton package"):
        A.stochastic_attention(q, k, v, 4, torch.arange(10))


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_integer_inputs_raise_as_sdpa_does(dtype):
    """SDPA refuses integer q, k, v; softmax(...) @ v would truncate them silently."""
    q, k, v = (torch.ones(1, 2, 10, 8, dtype=dtype) for _ in range(3))
    for name, (fast, ref) in attention_kinds(10, B=1, H=2).items():
        for fn in (fast, ref):
            with pytest.raises(ValueError, match=f"q, k, v must be floating point, got {dtype}"):
                fn(q, k, v)


@pytest.mark.parametrize("field,value", [("attn", "linear"), ("window", 0), ("n_embd", 30), ("sa_draw", "batch"),
                                         ("sa_rule", "slot"), ("pos_emb", "alibi"), ("moba_topk", 0), ("dropout", 1.0),
                                         ("dropout", math.nan), ("dropout", "0.1"), ("rope_base", 0),
                                         ("rope_base", -1.0),
                                         ("rope_base", math.inf), ("rope_base", math.nan), ("rope_base", 1e-300),
                                         ("rope_base", 1.0), ("bias", "no"),
                                         ("block_size", 2.5)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{"n_embd": 32, "n_head": 4, field: value})


def test_draws_of_the_wrong_length_raise():
    """draws=[perm] on a 2-layer SA model used to run layer 0 only (zip) and return logits."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, window=4, attn="sa"))
    idx, perm = torch.zeros(1, 16, dtype=torch.long), torch.arange(16)
    model(idx, draws=[perm, perm])
    for draws in ([perm], [perm] * 3, [], (p for p in [perm, perm]), perm, torch.stack([perm, perm])):  # a generator
        # had no len(); a stacked tensor's message printed it on many lines
        with pytest.raises(ValueError, match="draws must be a list of one draw per layer, 2, got a [A-Za-z]+( of .)?$"):
            model(idx, draws=draws)


def test_bad_model_inputs_raise_one_line():
    """Each of these used to end in a traceback (draws of None, float or out-of-vocabulary ids, a huge seed)."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, window=4, attn="sa+swa",
                          sa_draw="head"))
    idx = torch.zeros(2, 8, dtype=torch.long)
    for bad, problem in ((idx.float(), "idx must be a .B, T. tensor of token ids"), (idx[0], "idx must be a"),
                         (idx + 64, r"token ids outside \[0, vocab_size=64\)"), (idx - 1, "token ids outside")):
        with pytest.raises(ValueError, match=problem):
            model(bad)
    with pytest.raises(ValueError, match="perm must be a LongTensor .* got None"):
        model(idx, draws=[None, None])
    for targets, problem in ((idx.float(), "targets must be a .B, T. tensor"), (idx[:, :4], "of idx's shape"),
                             (idx + 64, r"targets holds token ids outside \[-1, vocab_size=64\)"),
                             (idx - 2, "outside")):
        with pytest.raises(ValueError, match=problem):
            model(idx, targets)
    assert model(idx, idx - 1)[1] is not None  # -1: ignored
    for seed in (2**70, -2**64, 1.5, "1", True):
        with pytest.raises(ValueError, match="seed must be an integer that fits in 64 bits"):
            model.seed_sa(seed)
    logits, loss = model(idx[:0], idx[:0])                                   # B = 0: empty, as nn.Linear's
    assert logits.shape == (0, 8, 64)


# -----------------------------------------------------------------------------
# The model: causality, training, determinism.

KINDS = list(M.ATTNS)


def tiny(attn, sa_draw="layer", seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(block_size=128, vocab_size=64, n_layer=2, n_head=2, n_embd=32, attn=attn, window=8,
               moba_chunk=8, moba_topk=3, sa_draw=sa_draw)
    return GPT(GPTConfig(**{**args, **kw}), sa_seed=seed)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
@pytest.mark.parametrize("sa_draw", ["layer", "head"])
@pytest.mark.parametrize("attn,sa_rule", [(a, "rank") for a in KINDS] + [("sa", "value"), ("sa+swa", "value")])
def test_no_future_leakage(attn, sa_rule, sa_draw, pos_emb):
    model = tiny(attn, sa_draw, pos_emb=pos_emb, sa_rule=sa_rule).eval()
    T, t = 100, 37
    x = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, t + 1:] = torch.randint(0, 64, (2, T - t - 1), generator=torch.Generator().manual_seed(1))
    model.seed_sa(5)
    a, _ = model(x)
    model.seed_sa(5)
    b, _ = model(y)
    assert torch.equal(a[:, :t + 1], b[:, :t + 1]), "logits of the past changed when the future changed"
    assert not torch.equal(a[:, t + 1:], b[:, t + 1:])  # the perturbation was real


def train_on_pairs(model, steps=50):
    """Losses of `steps` Adam steps on fresh batches of a b a b ... (a != b, random per row): the token after x
    is the other of its row's pair, uniform over 63 to a model that cannot look back (loss log 63 = 4.14);
    one look back (any earlier token of the other parity) gives it, so only attention can learn this."""
    g = torch.Generator().manual_seed(0)
    opt = model.configure_optimizers(0.0, 2e-2, (0.9, 0.95), "cpu")
    losses = []
    for _ in range(steps):
        x = torch.stack([torch.randperm(64, generator=g)[:2] for _ in range(16)]).repeat(1, 33)  # (16, 66)
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        if model.config.attn == "sa+swa":
            for layer in model.transformer.h:
                assert layer.attn.gate.weight.grad.abs().sum() > 0, "no gradient reached the SA/SWA gates"
        opt.step()
        losses.append(loss.item())
    return sum(losses[-5:]) / 5


@pytest.mark.parametrize("attn", KINDS)
def test_every_kind_learns_a_task_only_attention_solves(attn):
    assert train_on_pairs(tiny(attn)) < 0.5 * math.log(63)


def test_the_pair_task_needs_attention(monkeypatch):
    """The control: with attention returning zeros, the same training stays near log 63."""
    monkeypatch.setattr(A, "full_attention", lambda q, k, v: torch.zeros_like(v))
    assert train_on_pairs(tiny("full")) > 0.85 * math.log(63)


def test_sa_permutations_are_seeded_and_fresh_per_layer():
    a, b, c = tiny("sa", seed=0), tiny("sa", seed=0), tiny("sa", seed=0)
    c.seed_sa(123)
    x = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))
    first = a(x)[0]
    assert torch.equal(first, b(x)[0])      # same seed, same permutations, same output
    assert not torch.equal(first, c(x)[0])  # another seed, other permutations
    assert not torch.equal(first, a(x)[0])  # each forward pass draws fresh permutations
    cpu, state = torch.device("cpu"), a.sa_state
    perms = [M.sa_draw(state, [50], False, cpu) for _ in range(2)]
    assert all(sorted(p.tolist()) == list(range(50)) for p in perms)
    assert not torch.equal(perms[0], perms[1])
    heads = M.sa_draw(state, [2, 2, 50], False, cpu)
    assert sorted(heads[1, 0].tolist()) == list(range(50)) and not torch.equal(heads[0, 0], heads[1, 1])
    rs = M.sa_draw(state, [50], True, cpu)
    assert rs.dtype == torch.float32 and 0 <= rs.min() < rs.max() < 1


def test_swap_attention_refuses_untrained_gates():
    model = tiny("full")
    model.swap_attention(attn="sa", window=4)
    assert all(layer.attn.config.attn == "sa" for layer in model.transformer.h)
    with pytest.raises(ValueError, match="gates"):
        model.swap_attention(attn="sa+swa")
    with pytest.raises(ValueError, match="window"):
        model.swap_attention(window=0)
    for change in (dict(dropout=0.5), dict(rope_base=500.0), dict(block_size=64), dict(foo=1)):  # dropout and RoPE
        with pytest.raises(ValueError, match=f"swap_attention changes the attention .*, not {next(iter(change))}"):
            model.swap_attention(**change)                                  # were built once: silently unchanged


# -----------------------------------------------------------------------------
# torch.compile: each engine is a registered op (tiled.py, kernel.py), and so are SA's draws
# (model.sa_draws), so the GPT traces as one graph and trains as it does eagerly.

COMPILED = [(a, "rank") for a in KINDS] + [("sa+swa", "value")]


@pytest.mark.parametrize("attn,sa_rule", COMPILED)
def test_the_model_compiles_without_graph_breaks(attn, sa_rule, T=50):
    x = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(0))
    assert torch._dynamo.explain(tiny(attn, sa_draw="head", sa_rule=sa_rule))(x, x).graph_break_count == 0


@pytest.mark.parametrize("attn,sa_rule", COMPILED)
def test_compiled_training_equals_eager(attn, sa_rule, steps=5, T=50):
    """5 AdamW steps through torch.compile (Dynamo and AOTAutograd; Inductor's code generation is
    test_train's slow test) give eager's losses: the same SA draws, fresh at every step."""
    losses = []
    for compiled in (False, True):
        model = tiny(attn, sa_rule=sa_rule)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
        g, losses = torch.Generator().manual_seed(1), losses + [[]]
        for _ in range(steps):
            x = torch.randint(0, 64, (2, T), generator=g)
            loss = run(x[:, :-1], x[:, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[-1].append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-4) and len(set(losses[0])) == steps


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes rows past T too (0 / 0), never stored
def test_the_kernel_route_compiles_as_eager(monkeypatch):
    """The same through the Triton kernel (its interpreter here: short): no graph break, eager's losses."""
    monkeypatch.setattr(A, "ATTN_ENGINE", "triton")
    test_the_model_compiles_without_graph_breaks("sa+swa", "value", T=20)
    test_compiled_training_equals_eager("sa+swa", "rank", steps=2, T=20)


# -----------------------------------------------------------------------------
# Issue 44: inputs the fault run found, and a new kind in two places

def test_a_window_past_int64_is_full_attention_in_every_implementation():
    """The dense references compared |i - j| with the window in int64: from 2**63 they wrapped around (wrong), from
    2**64 they raised OverflowError. Every kind and reference now answers full attention there."""
    q, k, v = qkv(1, 2, 20, 8)
    full, perm, r = A.full_attention(q, k, v), random_perm((), 20), torch.rand(20)
    for w in (2**63, 2**64, 10**30):
        for fn in (A.sliding_window_attention, A.swa_reference, lambda *x: A.stochastic_attention(*x, perm),
                   lambda *x: A.sa_reference(*x, perm)):
            torch.testing.assert_close(fn(q, k, v, w), full)
        for fn in (A.stochastic_value_attention, A.sa_value_reference):
            torch.testing.assert_close(fn(q, k, v, float(w), r), full)


def test_numpy_integers_are_windows_and_sizes():
    """operator.index, as Python's own sequences take them: np.int64(8) was refused as a window or a chunk."""
    q, k, v = qkv(1, 2, 20, 8)
    perm = random_perm((), 20)
    for window in (np.int64(8), np.int32(8)):
        torch.testing.assert_close(A.sliding_window_attention(q, k, v, window), A.swa_reference(q, k, v, 8))
        torch.testing.assert_close(A.stochastic_attention(q, k, v, window, perm), A.sa_reference(q, k, v, 8, perm))
    torch.testing.assert_close(A.moba_attention(q, k, v, np.int64(4), np.int64(2)), A.moba_reference(q, k, v, 4, 2))
    r = torch.rand(20)
    torch.testing.assert_close(A.stochastic_value_attention(q, k, v, np.float32(0.25), r),
                               A.sa_value_reference(q, k, v, 0.25, r))
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=32, window=np.int64(4),
                       moba_chunk=np.int64(8))
    assert type(config.window) is int and config.window == 4 and type(config.moba_chunk) is int
    with pytest.raises(ValueError, match="window must be an integer >= 1, got np.float64"):
        A.sliding_window_attention(q, k, v, np.float64(8))


def test_a_window_tensor_is_a_window_only_if_an_integer():
    """torch.tensor(8) is a window; torch.tensor(8.) and a tensor of two were a TypeError from operator.index in the
    four functions that take a window (MoBA's chunk too): one line now."""
    q, k, v = qkv(1, 2, 20, 8)
    perm = random_perm((), 20)
    torch.testing.assert_close(A.sliding_window_attention(q, k, v, torch.tensor(8)), A.swa_reference(q, k, v, 8))
    for bad in (torch.tensor(8.0), torch.tensor([8, 8])):
        for fn in (lambda w: A.sliding_window_attention(q, k, v, w), lambda w: A.swa_reference(q, k, v, w),
                   lambda w: A.stochastic_attention(q, k, v, w, perm), lambda w: A.sa_reference(q, k, v, w, perm),
                   lambda w: A.moba_attention(q, k, v, w, 2)):
            with pytest.raises(ValueError, match="(window|moba_chunk) must be an integer >= 1, got tensor"):
                fn(bad)


def test_meta_tensors_are_refused_in_one_line():
    """Tensors on the meta device (shapes, no data) were internal errors in every attention function and in
    GPT.forward; they are refused at the door."""
    q = torch.empty(1, 2, 8, 4, device="meta")
    perm = torch.arange(8, device="meta")
    for fn in (A.full_attention, lambda *x: A.sliding_window_attention(*x, 4),
               lambda *x: A.stochastic_attention(*x, 4, perm), lambda *x: A.moba_attention(*x, 4, 2),
               lambda *x: A.swa_reference(*x, 4),
               lambda *x: A.masked_attention(*x, torch.ones(8, 8, dtype=torch.bool))):
        with pytest.raises(ValueError, match="q, k, v must be on one device that holds data, got meta"):
            fn(q, q, q)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=32, window=4))
    with pytest.raises(ValueError, match="idx must be a .* with data \\(not on meta\\)"):
        model(torch.zeros(1, 8, dtype=torch.long, device="meta"))


def test_masked_attention_checks_its_mask():
    q, k, v = qkv(1, 2, 8, 4)
    for mask in (torch.ones(8, 8), torch.ones(8, 7, dtype=torch.bool), [[True]], None):
        with pytest.raises(ValueError, match="mask must be a bool tensor broadcastable to"):
            A.masked_attention(q, k, v, mask)


def test_sa_value_hides_keys_at_exactly_delta():
    """Pairs at exactly delta (r multiples of 1/32, delta = 1/8: exact in fp32): the rule's strict < hides them.
    edge_pairs lands within ulps of delta but, at r's usual ulp, never on fp32(delta) itself."""
    T, delta = 32, 0.125
    r = random_perm((), T).float() / T
    assert ((r[:, None] - r[None, :]).abs() == delta).any()
    q, k, v = qkv(1, 2, T, 8)
    assert_same(lambda q, k, v: A.stochastic_value_attention(q, k, v, delta, r), q, k, v,
                lambda q, k, v: A.sa_value_reference(q, k, v, delta, r))


def test_sa_swa_gates_weigh_each_path():
    """Y = sigmoid(x W_sa) Y_sa + sigmoid(x W_swa) Y_swa, W_sa the gate's first n_head rows (results/reproduce.py
    reads them so). Untrained gates are all sigmoid(0) = 0.5, which hides a swapped or repeated half: random ones."""
    torch.manual_seed(0)
    config = GPTConfig(attn="sa+swa", block_size=32, vocab_size=61, n_layer=1, n_head=2, n_embd=16, window=4)
    attn = M.CausalSelfAttention(config)
    torch.nn.init.normal_(attn.gate.weight)
    (B, T, C), nh = (2, 20, 16), 2
    x, perm = torch.randn(B, T, C), random_perm((), T)
    with torch.no_grad():
        q, k, v = [t.view(B, T, nh, C // nh).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2)]
        g = torch.sigmoid(x @ attn.gate.weight.T).transpose(1, 2).unsqueeze(-1)  # (B, 2 * nh, T, 1)
        y = g[:, :nh] * A.stochastic_attention(q, k, v, 4, perm) + g[:, nh:] * A.sliding_window_attention(q, k, v, 4)
        torch.testing.assert_close(attn(x, None, perm), attn.c_proj(y.transpose(1, 2).reshape(B, T, C)))


# -----------------------------------------------------------------------------
# The reader's path: one forward of the model, followed in a debugger, stays short (nanoGPT's: 5 functions).

def repo_calls(attn):
    """(distinct repo functions, repo calls per layer) in one eager forward of a 2-layer GPT on the CPU (n_embd 32,
    T = 256), after a warm-up: every Python frame whose code is in the repo, lambdas and comprehensions included."""
    repo = os.path.dirname(os.path.abspath(__file__))
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=256, vocab_size=64, window=32, attn=attn))
    idx = torch.randint(0, 64, (2, 256), generator=torch.Generator().manual_seed(0))
    model(idx, idx)
    calls = {}

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(repo):
            calls[frame.f_code] = calls.get(frame.f_code, 0) + 1
    sys.setprofile(count)
    try:
        model(idx, idx)
    finally:
        sys.setprofile(None)
    return len(calls), sum(calls.values()) / model.config.n_layer


def test_one_forward_is_short_to_step_through():
    """SA+SWA (the default): at most 12 functions and 20 calls per layer (41 and 155 when the kinds were a table of
    lambdas behind a custom op); full attention: at most 8 calls per layer."""
    functions, per_layer = repo_calls("sa+swa")
    assert functions <= 12 and per_layer <= 20, (functions, per_layer)
    assert repo_calls("full")[1] <= 8
