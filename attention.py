"""Causal attention, q, k, v (B, H, T, D) -> (B, H, T, D): full, sliding-window (SWA), stochastic (SA) and MoBA.

SWA and both SA rules are one rule over a value and a position per token, stated here once; the dense references,
blocked.py's engine and kernel.py's Triton kernel all follow it, and test_attention.py holds them to it:

    key j is visible to query i  iff  |val[i] - val[j]| < width  and  pos[j] <= pos[i]

SWA: val = the slot index, width = window, pos = arange(T) by default (i - window < j <= i); with pos given, the
band reaches both sides and causality acts on pos. SA, the rank rule (the paper's): slot s holds token perm[s] of a
permutation perm; gather q, k, v by perm, run SWA with pos = perm, scatter back: tokens a >= b interact iff their
slots are fewer than `window` apart. SA, the value rule: one i.i.d. uniform r per token, val = r, width = delta,
pos = the token index: a >= b interact iff |r_a - r_b| < delta, by r_a and r_b alone, so a KV cache decodes it.
MoBA: query i sees its own block of keys (j <= i) and the top_k - 1 past blocks of largest q_i . mean(K_block).
Every query sees itself, and no query reads a key it may not see, not even a NaN in its k or v. Scores are fp32.
Each function takes q, k, v as SDPA does (guards.py); this file holds the attention, the dense references first.
"""
import functools
import importlib.util
import math
import os
import time
import warnings

import torch
import torch.nn.functional as F

import blocked
from guards import check_delta, check_draw, check_int, sdpa_inputs, v_seen_only

# The one switch, which implementation the fast functions run: "auto": the Triton kernel for CUDA tensors (a
#   Triton of TRITON_VERSIONS, a head dim and dtype it has); "torch": blocked.py, O(T * window) time and memory,
#   no T x T tensor; "triton": the kernel (on the CPU too, under TRITON_INTERPRET=1); "reference": the O(T^2)
#   oracle, the masks below, which a debugger steps through line by line
BACKEND = "auto"
BACKENDS = ("auto", "torch", "triton", "reference")
TRITON_VERSIONS = ((3, 2), (3, 9))  # Triton minors tested: results/kernel_triton_versions.txt
VALUE_MARGIN = 1e-6  # the value rule's key spans reach this much past delta: fp32 rounding of |r_i - r_j| (r < 1)


# -----------------------------------------------------------------------------
# The dense references: O(T^2), the oracle of every test; each kind's mask sits next to its fast path.

def rule_mask(val, pos, width):
    """THE rule, dense: (..., T, T) bool, True where query i may see key j; val and pos (T,) or (..., T)."""
    near = (val[..., :, None] - val[..., None, :]).abs() < width         # (..., T, T)
    return near & (pos[..., None, :] <= pos[..., :, None])


@functools.partial(sdpa_inputs, any_length=True)
@v_seen_only
def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D) where mask else -inf) @ v, the scores and softmax in fp32 (no fp16 overflow)."""
    scores = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill_(
        ~mask, torch.finfo(torch.float32).min)                                     # (B, H, T, T)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v                          # (B, H, T, D)


@sdpa_inputs
@v_seen_only
def full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# -----------------------------------------------------------------------------
# SWA, and both SA rules through it.

def swa_mask(T, window, pos=None, device=None):
    """SWA's mask in slot order: val = the slot index, pos = arange(T) by default."""
    idx = torch.arange(T, device=device)
    return rule_mask(idx, idx if pos is None else pos, check_int(window))


@sdpa_inputs
def swa_reference(q, k, v, window, pos=None):
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, check_draw(pos, "pos", q), q.device))


@sdpa_inputs
def sliding_window_attention(q, k, v, window, pos=None):
    """SWA, with positions (the rule above): out (B, H, T, D) for q, k, v (B, H, T, D); pos a LongTensor (T,) or
    broadcastable to (B, H, T). Without pos, FlashAttention's window_size=(window-1, 0). Equals swa_reference."""
    return _band(q, k, v, check_draw(pos, "pos", q), window=check_int(window))


def sa_mask(window, perm):
    """SA's rank rule in ORIGINAL token order: val = each token's slot, pos = arange(T)."""
    return rule_mask(torch.argsort(perm, dim=-1), torch.arange(perm.shape[-1], device=perm.device), check_int(window))


@sdpa_inputs
def sa_reference(q, k, v, window, perm):
    return masked_attention(q, k, v, sa_mask(window, check_draw(perm, "perm", q)))


def gather(t, perm):
    """t (B, H, T, D) in slot order, slot s holding token perm[..., s]; perm (T,) or broadcastable to (B, H, T)."""
    if perm.dim() == 1:
        return t.index_select(2, perm)                                       # (B, H, T, D): the fast row copy
    b, h = (torch.arange(n, device=t.device) for n in t.shape[:2])           # (B,), (H,)
    return t[b[:, None, None], h[None, :, None], perm.expand(*t.shape[:3])]  # (B, H, T, D)


def scatter(ys, perm):
    """gather's inverse: ys (B, H, T, D) in slot order, back in token order."""
    return gather(ys, torch.argsort(perm, dim=-1))                           # (B, H, T, D)


@sdpa_inputs
def stochastic_attention(q, k, v, window, perm):
    """SA by the rank rule (above), perm (T,) or broadcastable to (B, H, T): a query sees ~`window` keys, window >= T
    is full attention, the identity perm is SWA. Equals sa_reference. The last three lines are README.md's recipe;
    in slot order each slot's original position is perm itself, so perm is SWA's pos there."""
    check_draw(perm, "perm", q)
    qs, ks, vs = gather(q, perm), gather(k, perm), gather(v, perm)  # gather into permuted order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)     # SWA there, causal on original positions
    return scatter(ys, perm)                                        # scatter back to token order


def row_perms(seed, lengths, T, heads=1):
    """SA's permutations for right-padded rows: (B, heads, T), row b permuting only its first lengths[b] tokens,
    its pads keeping their slots after them. From `seed` and the row's length alone, never the rest of the batch."""
    rows = [torch.cat([torch.rand(heads, n, generator=torch.Generator().manual_seed(seed)).argsort(-1),  # (heads, n)
                       torch.arange(n, T).expand(heads, -1)], -1) for n in lengths.tolist()]          # (heads, T)
    return torch.stack(rows)                                                                           # (B, heads, T)


def sa_value_mask(delta, r):
    """SA's value rule in token order: val = r, width = delta, pos = arange(T)."""
    return rule_mask(r, torch.arange(r.shape[-1], device=r.device), check_delta(delta))


@sdpa_inputs
def sa_value_reference(q, k, v, delta, r):
    return masked_attention(q, k, v, sa_value_mask(delta, check_draw(r, "r", q)))


@sdpa_inputs
def stochastic_value_attention(q, k, v, delta, r):
    """SA by the value rule (above), r (T,) or broadcastable to (B, H, T): delta = window / T connects a pair as often
    as the rank rule. Sorted by r, a block of queries sees one contiguous key span. Equals sa_value_reference."""
    check_draw(r, "r", q)
    check_delta(delta)
    perm = torch.argsort(r, dim=-1, stable=True)                       # (T,) or (B, H, T): ascending r
    r_sorted = r.gather(-1, perm).float()                              # (T,) or (B, H, T): each slot's r
    return scatter(_band(gather(q, perm), gather(k, perm), gather(v, perm), perm, delta=delta, r_sorted=r_sorted), perm)


# -----------------------------------------------------------------------------
# MoBA: each query's own block plus the past blocks its router (blocked.moba_select) picks.

def moba_mask(q, k, moba_block, top_k):
    """MoBA's rule: (B, H, T, T) bool, True where query i sees key j: j <= i, in i's block or one moba_select picked."""
    T = q.shape[2]
    moba_block = min(check_int(moba_block, "moba_block"), T)  # a block of T keys or more: the same rule, in memory of T
    check_int(top_k, "top_k")
    idx, ok = blocked.moba_select(q, k, moba_block, top_k)
    chosen = torch.zeros(*idx.shape[:3], math.ceil(T / moba_block), dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)                                         # (B, H, T, nblk)
    blk = torch.arange(T, device=q.device) // moba_block
    chosen[..., torch.arange(T), blk] = True                             # own block
    return chosen[..., blk] & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (B, H, T, T): causal


@sdpa_inputs
def moba_reference(q, k, v, moba_block, top_k):
    return masked_attention(q, k, v, moba_mask(q, k, moba_block, top_k))


@sdpa_inputs
def moba_attention(q, k, v, moba_block, top_k):
    """MoBA (Mixture of Block Attention, the rule above): out (B, H, T, D). Equals moba_reference."""
    moba_block, top_k = min(check_int(moba_block, "moba_block"), q.shape[2]), check_int(top_k, "top_k")
    if _backend(q) == "reference":
        return moba_reference(q, k, v, moba_block, top_k)
    idx, ok = blocked.moba_select(q, k, moba_block, top_k)             # routed once, on the true q, k
    return v_seen_only(lambda q, k, v: blocked.moba(q, k, v, idx, ok, moba_block)[0])(q, k, v)


# -----------------------------------------------------------------------------
# The backends: which implementation runs the band of SWA and SA.

@v_seen_only
def _band(q, k, v, pos, window=None, delta=None, r_sorted=None):
    """The rule over slots, by window (val = the slot index) or by delta over r_sorted (ascending); pos None: SWA."""
    backend, width, val = _backend(q), window if r_sorted is None else delta, r_sorted
    if backend == "reference":
        return masked_attention(q, k, v, rule_mask(val, pos, width) if val is not None else
                                swa_mask(q.shape[2], width, pos, q.device))
    if backend == "triton":
        import kernel
        try:  # the kernel checks itself at each variant's first use (kernel.check_once)
            return kernel.triton_swa(q, k, v, width, pos, val, VALUE_MARGIN)
        except kernel.CANNOT_RUN as e:
            if BACKEND == "triton":
                raise
            warnings.warn(f"the Triton kernel cannot run, using the torch path instead: {_why(e)}")
    return blocked.band(q, k, v, pos, val, width, VALUE_MARGIN)[0]


@functools.lru_cache  # decided, and warned about, once
def _triton_supported():
    """Whether "auto" may run the kernel with the installed Triton; if not, a warning says so."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton
    if TRITON_VERSIONS[0] <= tuple(int(x) for x in triton.__version__.split(".")[:2]) <= TRITON_VERSIONS[1]:
        return True
    warnings.warn(f"Triton {triton.__version__} is outside the tested range {TRITON_VERSIONS}: using the torch path")


def _backend(q):
    if BACKEND not in BACKENDS:
        raise ValueError(f"attention.BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
    if BACKEND == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("backend 'triton' needs the triton package (pip install triton); 'auto' or 'torch' runs "
                         "without it")
    if BACKEND == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' runs the Triton kernel on a CUDA GPU, not on {q.device} (except under "
                         "TRITON_INTERPRET=1, slowly, for tests): use backend 'auto' or 'torch'")
    if BACKEND == "auto" and q.is_cuda and _triton_supported():
        import kernel
        return "triton" if q.shape[-1] in kernel.HEAD_DIMS and q.dtype in kernel.SUPPORTED_DTYPES else "torch"
    return "torch" if BACKEND == "auto" else BACKEND


def _why(e):
    """Why the kernel cannot run, in one line: the exception's type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def backend_line(device, dtype, head_dim, kinds, sa_rule="rank"):
    """The line train.py, sample.py and eval.py print: what runs the SWA and SA of these attention kinds (a list) in
    dtype on device. On a GPU, the kernel, whose self-check of each variant runs now, before any training."""
    q, kinds = torch.empty(0, 0, 0, head_dim, device=device, dtype=dtype), [kinds] if isinstance(kinds, str) else kinds
    variants = [r for r, users in (("swa", {"swa", "sa+swa"}), ("sa " + sa_rule, {"sa", "sa+swa"}))
                if users & set(kinds)]
    if not variants or _backend(q) != "triton":
        return f"attention: {'the ' + _backend(q) + ' path' if variants else 'no SWA or SA'} on {q.device}"
    import kernel
    failed, start, where = {}, time.perf_counter(), f"{kernel.where(q.device)} {str(dtype)[6:]}"
    for variant in variants:
        try:
            kernel.check_once(q.device, dtype, head_dim, variant, VALUE_MARGIN)
        except kernel.CANNOT_RUN as e:  # as at the first call: "triton" raises, "auto" takes the torch path
            if BACKEND == "triton":
                raise
            failed[variant] = _why(e)
    if failed:
        reasons = "; ".join(dict.fromkeys(failed.values()))  # each once, in order
        return f"attention: the torch path for {', '.join(failed)} on {where}: {reasons}"
    if not kernel.SELF_CHECK:
        return f"attention: Triton kernel on {where}, self-check off"
    err = max(kernel.SELF_CHECKS[q.device, dtype, head_dim, variant] for variant in variants)
    return (f"attention: Triton kernel, self-check passed on {where} (max err {err:.1e}, "
            f"{time.perf_counter() - start:.1f} s)")
