"""Read first. Causal attention, q, k, v (B, H, T, D) -> (B, H, T, D): full, sliding-window (SWA), stochastic (SA),
MoBA. SWA and both SA rules are one rule over a slot and a position per token, which the dense references, tiled.py
and kernel.py follow (tested in test_attention.py, tests/test_kernel.py):

    key j is visible to query i  iff  |slot[i] - slot[j]| < width  and  pos[j] <= pos[i]

SWA: slot = the index, width = window, pos = arange(T) by default (i - window < j <= i); a given pos makes the band
two-sided, causal on pos. SA, the rank rule (the paper's): slot s holds token perm[s]; gather q, k, v by perm, run SWA
with pos = perm, gather back: tokens a >= b interact iff their slots are < window apart. SA, the value rule: slot = an
i.i.d. uniform r per token, width = delta, pos = the index: a >= b interact iff |r_a - r_b| < delta, by r_a and r_b
alone, so a KV cache decodes it. MoBA: query i sees its own chunk (j <= i) and the top_k - 1 past chunks of largest
q_i . mean(K_chunk). Every query sees itself; no query reads a key it may not see, not even a NaN in its k, nor, on the
CPU eagerly, in its v (elsewhere it may reach its tile's other queries: _exact). Scores are fp32. pos, perm and r are
(T,) or broadcastable to (B, H, T). Each function checks q, k, v (guards.check_inputs) and, as SDPA, takes them in
autocast's dtype under autocast.
"""
import functools
import importlib.util
import math
import os
import time
import warnings

import torch
import torch.nn.functional as F

import tiled
from guards import InputError, check_count, check_delta, check_inputs

# What runs SWA's and SA's band: "auto": the Triton kernel on CUDA (Triton in TRITON_VERSIONS, a head dim and dtype it
# has, its checks passed), else "torch": tiled.py, O(T * window); "triton": the kernel (CPU: TRITON_INTERPRET=1; SWA
# over a given pos, which SA's one launch replaces, runs on tiled.py); "dense": _dense. Full attention is SDPA.
ENGINE = "auto"
ENGINES = ("auto", "torch", "triton", "dense")
KERNEL_DEVICES = ("cuda",)  # where "auto" may run the kernel (a test adds "cpu": the interpreter plays a GPU)
TRITON_VERSIONS = ((3, 2), (3, 9))  # Triton minors tested: results/kernel_triton_versions.txt
VALUE_MARGIN = 1e-6  # the value rule's key spans reach this far past delta: fp32 rounding of |r_i - r_j| (r < 1)


# The dense references: O(T^2), every test's oracle, each beside its fast function.

def rule_mask(slot, pos, width):
    """THE rule, dense: (..., T, T) bool, True where query i may see key j; slot and pos (T,) or (..., T)."""
    near = (slot[..., :, None] - slot[..., None, :]).abs() < width  # (..., T, T)
    return near & (pos[..., None, :] <= pos[..., :, None])


def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D), hidden keys at fp32's min) @ v; keys may outnumber queries (a KV cache step). A
    non-finite v[j, d] reaches out[i, d] only if mask[i, j]."""
    q, k, v = check_inputs(q, k, v, any_length=True, mask=mask)
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill_(
            ~mask, torch.finfo(torch.float32).min)  # (B, H, T, S)
        p = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, T, S)
        bad = ~v.isfinite()  # (B, H, S, D)
        if not bad.any():
            return p @ v  # (B, H, T, D)
        seen = (mask.to(v.dtype) @ bad.to(v.dtype)) > 0  # (B, H, T, D): i sees a bad v[j, d]
        return (p @ v.masked_fill(bad, 0)).masked_fill(seen, math.nan)


def full_attention(q, k, v):
    """Causal attention by PyTorch's SDPA (its flash kernels where they run)."""
    q, k, v = check_inputs(q, k, v)
    return _exact(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)


# SWA, and both SA rules through it.

def swa_mask(T, window, pos=None, device=None):
    """SWA's mask in slot order: slot = the index, pos = arange(T) by default."""
    idx = torch.arange(T, device=device)
    return rule_mask(idx, idx if pos is None else pos, min(check_count(window, "window"), T))  # no int64 overflow


def swa_reference(q, k, v, window, pos=None):
    check_inputs(q, k, v, window=window, pos=pos)
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, pos, q.device))


def sliding_window_attention(q, k, v, window, pos=None):
    """SWA by the rule above; without pos, FlashAttention's window_size=(window-1, 0). Equals swa_reference."""
    q, k, v = check_inputs(q, k, v, window=window, pos=pos)
    engine = _engine(q, "swa" if pos is None else None)
    if engine == "triton":
        return _exact(_kernel, q, k, v, float(window))
    return _exact(BANDS[engine], q, k, v, pos, None, float(window), VALUE_MARGIN)


def sa_mask(window, perm):
    """SA's rank rule in token order: slot = each token's slot (perm's inverse), pos = arange(T)."""
    T = perm.shape[-1]
    return rule_mask(perm.argsort(-1), torch.arange(T, device=perm.device), min(check_count(window, "window"), T))


def sa_reference(q, k, v, window, perm):
    check_inputs(q, k, v, window=window, perm=perm)
    return masked_attention(q, k, v, sa_mask(window, perm))


def gather(t, perm):
    """t (B, H, T, D) in slot order: slot s holds token perm[..., s]; gather(t_slots, perm.argsort(-1)) undoes it."""
    if perm.dim() == 1:
        return t.index_select(2, perm)  # (B, H, T, D): the fast row copy
    b, h = (torch.arange(n, device=t.device) for n in t.shape[:2])  # (B,), (H,)
    return t[b[:, None, None], h[None, :, None], perm.expand(*t.shape[:3])]  # (B, H, T, D)


def stochastic_attention(q, k, v, window, perm):
    """SA by the rank rule: a query sees ~`window` keys; window >= T is full attention, the identity perm SWA. Equals
    sa_reference. The last three lines are README.md's recipe."""
    q, k, v = check_inputs(q, k, v, window=window, perm=perm)
    if _engine(q, "sa rank") == "triton":  # the three lines below in one launch: rows read and written through perm
        return _exact(_kernel, q, k, v, float(window), perm)
    qs, ks, vs = gather(q, perm), gather(k, perm), gather(v, perm)  # (B, H, T, D) each, in permuted (slot) order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)     # SWA there, causal on original positions
    return gather(ys, perm.argsort(-1))                             # back to token order: gather by perm's inverse


def row_perms(seed, lengths, T, heads=1):
    """SA's permutations (B, heads, T) for right-padded rows: row b permutes its first lengths[b] tokens, its pads
    keep their slots. Drawn from `seed` and the row's length alone."""
    rows = [torch.cat([torch.rand(heads, n, generator=torch.Generator().manual_seed(seed)).argsort(-1),  # (heads, n)
                       torch.arange(n, T).expand(heads, -1)], -1) for n in lengths.tolist()]  # (heads, T) each
    return torch.stack(rows)  # (B, heads, T)


def sa_value_mask(delta, r):
    """SA's value rule in token order: slot = r, width = delta, pos = arange(T)."""
    return rule_mask(r, torch.arange(r.shape[-1], device=r.device), check_delta(delta))


def sa_value_reference(q, k, v, delta, r):
    check_inputs(q, k, v, delta=delta, r=r)
    return masked_attention(q, k, v, sa_value_mask(delta, r))


def stochastic_value_attention(q, k, v, delta, r):
    """SA by the value rule: delta = window / T connects a pair as often as the rank rule. Sorted by r, a tile of
    queries sees one contiguous key span. Equals sa_value_reference."""
    q, k, v = check_inputs(q, k, v, delta=delta, r=r)
    r_sorted, perm = torch.sort(r, dim=-1, stable=True)  # (T,) or (B, H, T): each slot's r, ascending, and its token
    engine = _engine(q, "sa value")
    if engine == "triton":  # one launch, as for the rank rule
        return _exact(_kernel, q, k, v, float(delta), perm, r_sorted.float(), VALUE_MARGIN)
    qs, ks, vs = gather(q, perm), gather(k, perm), gather(v, perm)  # (B, H, T, D) each, sorted by r
    ys = _exact(BANDS[engine], qs, ks, vs, perm, r_sorted.float(), float(delta), VALUE_MARGIN)  # the band over r
    return gather(ys, perm.argsort(-1))  # (B, H, T, D): back to token order


# MoBA: each query's own chunk plus the past chunks tiled.moba_select picks.

def moba_mask(q, k, moba_chunk, top_k):
    """MoBA's rule: (B, H, T, T) bool, True where query i sees key j: j <= i, in i's chunk or one moba_select picked."""
    T, top_k = q.shape[2], check_count(top_k, "top_k")
    moba_chunk = max(1, min(check_count(moba_chunk, "moba_chunk"), T))  # a chunk of T keys or more: the same rule
    idx, ok = tiled.moba_select(q, k, moba_chunk, top_k)
    chosen = torch.zeros(*idx.shape[:3], math.ceil(T / moba_chunk), dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)  # (B, H, T, nchunks)
    chunk = torch.arange(T, device=q.device) // moba_chunk
    chosen[..., torch.arange(T), chunk] = True  # own chunk
    return chosen[..., chunk] & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (B, H, T, T): causal


def moba_reference(q, k, v, moba_chunk, top_k):
    q, k, v = check_inputs(q, k, v, moba_chunk=moba_chunk, top_k=top_k)
    return masked_attention(q, k, v, moba_mask(q, k, moba_chunk, top_k))


def moba_attention(q, k, v, moba_chunk, top_k):
    """MoBA (Mixture of Block Attention; its blocks are our chunks). Equals moba_reference."""
    q, k, v = check_inputs(q, k, v, moba_chunk=moba_chunk, top_k=top_k)
    moba_chunk = max(1, min(int(moba_chunk), q.shape[2]))  # a chunk of T keys or more: the same rule, in memory of T
    idx, ok = tiled.moba_select(q, k, moba_chunk, int(top_k))  # routed once, on the true q, k
    return _exact(lambda q, k, v: tiled.moba(q, k, v, idx, ok, moba_chunk)[0], q, k, v)


# Support, for a second reading: what runs the band, and _exact.

def _exact(engine, q, k, v, *args):
    """engine(q, k, v, *args), autocast off (the kernel runs no op autocast casts); an empty B, H, T or D gives the empty output on the autograd graph. On the
    CPU, eagerly, a non-finite v[j, d] (p @ v spreads it: 0 * NaN = NaN) reaches out[i, d] only if query i sees key j
    (the engine on q = k = 0 and v's bad entries weighs each visible key >= 1/T, each hidden one 0); not on a GPU (the
    check would wait for it), compiled, or in the kernel."""
    if q.numel() == 0 or k.numel() == 0:
        return q.new_zeros(*q.shape[:3], v.shape[3]) + (q.sum() + k.sum() + v.sum())
    if engine is _kernel:  # no torch op in it that autocast casts
        return engine(q, k, v, *args)
    with torch.autocast(q.device.type, enabled=False):
        if q.device.type != "cpu" or torch.compiler.is_compiling() or bool(v.sum().isfinite()):
            return engine(q, k, v, *args)
        bad = ~v.isfinite()  # (B, H, T, D)
        with torch.no_grad():
            seen = engine(torch.zeros_like(q), torch.zeros_like(k), bad.to(v.dtype), *args) > 0
        return engine(q, k, v.masked_fill(bad, 0), *args).masked_fill(seen, math.nan)  # (B, H, T, D)


def _dense(q, k, v, pos, r, width, margin):
    """The band as a dense rule_mask in slot order, plain code to step through."""
    idx = torch.arange(q.shape[2], device=q.device)  # (T,): SWA's slot, and its pos by default
    mask = rule_mask(idx if r is None else r, idx if pos is None else pos, min(width, q.shape[2]))  # r comes with pos
    return masked_attention(q, k, v, mask)


BANDS = {"torch": tiled.band_attention, "dense": _dense}  # (q, k, v, pos, r, width, margin) in slot order


def _kernel(q, k, v, *args):
    import kernel
    return kernel.triton_swa(q, k, v, *args)


def _engine(q, rule):
    """What runs q's band by ENGINE: "triton" (the kernel, for rule "swa", "sa rank" or "sa value"; None: no kernel
    rule), "torch" or "dense"."""
    if ENGINE not in ENGINES:
        raise InputError(f"attention.ENGINE must be one of {ENGINES}, got {ENGINE!r}")
    if ENGINE == "triton" and rule:
        if not _has_triton():
            raise InputError("attn_engine 'triton' needs the triton package (pip install triton); 'auto' or 'torch' "
                             "runs without it")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise InputError(f"attn_engine 'triton' runs the Triton kernel on a CUDA GPU, not on {q.device} (or on the "
                             "CPU under TRITON_INTERPRET=1, for tests): use attn_engine 'auto' or 'torch'")
        return "triton"
    H, T, D = q.shape[1:]
    if ENGINE == "auto" and rule and H * T * D < 2**31 and _kernel_ok(q.device, q.dtype, D, rule):  # int32 offsets
        return "triton"
    return "dense" if ENGINE == "dense" else "torch"


@torch.compiler.assume_constant_result  # decided before tracing: a compiled graph never holds a kernel that refuses
def _kernel_ok(device, dtype, D, rule):
    """Whether "auto" runs the kernel (_refusal); one warning where it failed a check."""
    why = _refusal(device, dtype, D, rule)
    if why:
        warnings.warn(f"the Triton kernel cannot run, using the torch engine instead: {why}")
    return why is None


def _refusal(device, dtype, D, rule):
    """None where "auto" runs the kernel (ENGINE's conditions; kernel.check_once checks the GPU, then self-checks at
    the first use); else "" (not tried), or why not."""
    if device.type not in KERNEL_DEVICES or not _triton_supported():
        return ""
    import kernel
    if D not in kernel.HEAD_DIMS or dtype not in kernel.SUPPORTED_DTYPES:
        return ""
    try:
        kernel.check_once(device, dtype, D, rule, VALUE_MARGIN)
    except kernel.CANNOT_RUN as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"  # its message's first line
    return None


@torch.compiler.assume_constant_result  # a constant to torch.compile: torch 2.11's Dynamo breaks the graph at find_spec
def _has_triton():
    return importlib.util.find_spec("triton") is not None


@functools.cache  # read once (Dynamo never traces it: _kernel_ok is a constant)
def _triton_supported():
    """Whether Triton is installed and in TRITON_VERSIONS (outside them: one warning)."""
    if not _has_triton():
        return False
    import triton
    if TRITON_VERSIONS[0] <= tuple(int(x) for x in triton.__version__.split(".")[:2]) <= TRITON_VERSIONS[1]:
        return True
    warnings.warn(f"Triton {triton.__version__} is outside the tested range {TRITON_VERSIONS}: using the torch engine")
    return False


def engine_line(device, dtype, head_dim, kinds, sa_rule="rank"):
    """The line train.py, sample.py and eval.py print: what runs the SWA and SA of kinds (a list, or one) in dtype on
    device. On a GPU, the kernel's checks for each rule run now, before any training."""
    q = torch.empty(0, 0, 0, head_dim, device=device, dtype=dtype)
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    rules = [r for r, users in (("swa", {"swa", "sa+swa"}), ("sa " + sa_rule, {"sa", "sa+swa"})) if users & kinds]
    engine, start = _engine(q, None), time.perf_counter()  # None: "torch" or "dense", its errors one line
    why = {rule: _refusal(q.device, dtype, head_dim, rule) for rule in rules} if ENGINE == "auto" else {}
    if not rules or ENGINE not in ("auto", "triton") or "" in why.values():  # "": "auto" did not try the kernel
        return f"attention: {f'the {engine} engine' if rules else 'no SWA or SA'} on {q.device}"
    import kernel
    if ENGINE == "triton":
        _engine(q, rules[0])  # its one-line refusals
        for rule in rules:
            kernel.check_once(q.device, dtype, head_dim, rule, VALUE_MARGIN)  # raises where the kernel cannot run
    failed = {rule: reason for rule, reason in why.items() if reason}
    where = f"{kernel.where(q.device)} {str(dtype)[6:]}"
    if failed:
        reasons = "; ".join(dict.fromkeys(failed.values()))  # each once, in order
        return f"attention: the torch engine for {', '.join(failed)} on {where}: {reasons}"
    if not kernel.SELF_CHECK:
        return f"attention: Triton kernel on {where}, self-check off"
    err = max(kernel.SELF_CHECKS[q.device, dtype, head_dim, rule] for rule in rules)
    return (f"attention: Triton kernel, self-check passed on {where} (max err {err:.1e}, "
            f"{time.perf_counter() - start:.1f} s)")
