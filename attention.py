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

# The one switch, which implementation the fast functions run: "auto": the Triton kernel for CUDA tensors (a
#   Triton of TRITON_VERSIONS, a head dim and dtype it has); "torch": blocked.py, O(T * window) time and memory,
#   no T x T tensor; "triton": the kernel (on the CPU too, under TRITON_INTERPRET=1); "reference": the O(T^2) oracle
BACKEND = "auto"
BACKENDS = ("auto", "torch", "triton", "reference")
TRITON_VERSIONS = ((3, 2), (3, 9))  # Triton minors tested: results/kernel_triton_versions.txt
VALUE_MARGIN = 1e-6  # the value rule's key spans reach this much past delta: fp32 rounding of |r_i - r_j| (r < 1)


def check_positive(value, name="window"):
    """value, if it is an integer >= 1 (a window, a block size, ...); else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_draw(draw, name, q):
    """SA's draw: permutations `perm` of range(T), or finite value keys `r`; (T,) or broadcastable to (B, H, T),
    on q's device."""
    (B, H, T), kind = q.shape[:3], "a LongTensor" if name == "perm" else "a float tensor"
    if not isinstance(draw, torch.Tensor):
        raise ValueError(f"{name} must be {kind} of shape (T,) or (B, H, T), got {type(draw).__name__}")
    ok = draw.dtype == torch.long if name == "perm" else draw.is_floating_point()
    if not ok or draw.dim() not in (1, 3) or any(n not in (1, m) for n, m in zip(draw.shape[:-1], (B, H))) \
            or draw.shape[-1] != T:
        raise ValueError(f"{name} must be {kind} of shape (T,) or broadcastable to (B, H, T)=({B}, {H}, {T}), "
                         f"got {draw.dtype} {tuple(draw.shape)}")
    if draw.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {draw.device}")
    if torch.compiler.is_compiling():                                   # values unknown while tracing: eager only
        return
    rows = draw.reshape(-1, T)                                          # (R, T)
    if name == "r" and not bool(rows.isfinite().all()):
        raise ValueError("r must be finite, got NaN or inf")
    if name == "perm":
        hit = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.clamp(0, T - 1), True)  # (R, T): O(T)
        if not bool(hit.all() & (rows >= 0).all() & (rows < T).all()):
            raise ValueError(f"perm must be a permutation of range({T}) in every row")


def _sdpa_inputs(fn, any_length=False):
    """fn(q, k, v, ...) taking its inputs as SDPA does: one-line errors for shapes and integer dtypes (softmax @ v
    would truncate), an empty output at T = 0, under autocast q, k, v in its dtype."""
    @functools.wraps(fn)
    def run(q, k, v, *args, **kwargs):
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            raise ValueError(f"q, k, v must be tensors, got {', '.join(type(t).__name__ for t in (q, k, v))}")
        if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] \
                or not (any_length or q.shape == k.shape):
            raise ValueError(f"q, k, v must be (B, H, T, D) of one shape, got {[tuple(t.shape) for t in (q, k, v)]}")
        if not all(t.is_floating_point() for t in (q, k, v)):
            raise ValueError(f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not q.device == k.device == v.device:
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
        if torch.is_autocast_enabled(device := q.device.type):
            with torch.autocast(device, enabled=False):
                return run(*(t.to(torch.get_autocast_dtype(device)) for t in (q, k, v)), *args, **kwargs)
        if not q.dtype == k.dtype == v.dtype:  # as SDPA: no silent cast of the others to q's dtype
            raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.numel() == 0 or k.numel() == 0:  # an empty B, H, T or D: SDPA's empty output, on the autograd graph
            return q.new_zeros(*q.shape[:3], v.shape[3]) + (q.sum() + k.sum() + v.sum())
        return fn(q, k, v, *args, **kwargs)
    return run


def _v_seen_only(fn):
    """fn(q, k, v, ...), rule fixed by the rest, where non-finite v[j, d] reaches out[i, d] only if query i sees key j
    (p @ v has 0 * NaN = NaN). Fast: one sum shows v finite (as blocked._finite). Else fn on v's non-finite entries
    zeroed, NaN where fn on q = k = 0 (visible keys weigh >= 1/T, hidden 0) reads them: no path changes. Eager only."""
    @functools.wraps(fn)
    def run(q, k, v, *args):
        if torch.compiler.is_compiling() or bool(v.sum().isfinite()):    # compiled: bool() would break the graph
            return fn(q, k, v, *args)
        nonfinite = ~v.isfinite()                                           # (B, H, T, D)
        with torch.no_grad():
            seen = fn(torch.zeros_like(q), torch.zeros_like(k), nonfinite.to(v.dtype), *args) > 0  # (B, H, T, D)
        return fn(q, k, v.masked_fill(nonfinite, 0), *args).masked_fill(seen, math.nan)
    return run


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


def engine(device, dtype, head_dim, kinds, sa_rule="rank"):
    """The line train.py, sample.py and eval.py print: what runs the SWA and SA of these attention kinds (a list) in
    dtype on device. On a GPU, the kernel, whose self-check of each rule runs now, before any training."""
    q = torch.empty(0, 0, 0, head_dim, device=device, dtype=dtype)
    rules = [r for r, users in (("swa", {"swa", "sa+swa"}), ("sa " + sa_rule, {"sa", "sa+swa"})) if users & set(kinds)]
    if not rules or _backend(q) != "triton":
        return f"attention: {'the ' + _backend(q) + ' path' if rules else 'no SWA or SA'} on {q.device}"
    import kernel
    failed, start, where = {}, time.perf_counter(), f"{kernel.where(q.device)} {str(dtype)[6:]}"
    for rule in rules:
        try:
            kernel.check_once(q.device, dtype, head_dim, rule, VALUE_MARGIN)
        except kernel.CANNOT_RUN as e:  # as at the first call: "triton" raises, "auto" takes the torch path
            if BACKEND == "triton":
                raise
            failed[rule] = _why(e)
    if failed:
        reasons = "; ".join(dict.fromkeys(failed.values()))  # each once, in order
        return f"attention: the torch path for {', '.join(failed)} on {where}: {reasons}"
    if not kernel.SELF_CHECK:
        return f"attention: Triton kernel on {where}, self-check off"
    err = max(kernel.SELF_CHECKS[q.device, dtype, head_dim, rule] for rule in rules)
    return (f"attention: Triton kernel, self-check passed on {where} (max err {err:.1e}, "
            f"{time.perf_counter() - start:.1f} s)")


# -----------------------------------------------------------------------------
# The dense references: O(T^2), the oracle of every test; each kind's mask sits next to its fast path.

@_sdpa_inputs
@_v_seen_only
def full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@functools.partial(_sdpa_inputs, any_length=True)
@_v_seen_only
def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D) where mask else -inf) @ v, the scores and softmax in fp32 (no fp16 overflow)."""
    scores = (q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill_(
        ~mask, torch.finfo(torch.float32).min)                                     # (B, H, T, T)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v                          # (B, H, T, D)


def rule_mask(val, pos, width):
    """THE rule, dense: (..., T, T) bool, True where query i may see key j; val and pos (T,) or (..., T)."""
    near = (val[..., :, None] - val[..., None, :]).abs() < width         # (..., T, T)
    return near & (pos[..., None, :] <= pos[..., :, None])


# -----------------------------------------------------------------------------
# SWA, and both SA rules through it.

def swa_mask(T, window, pos=None, device=None):
    """SWA's mask in slot order: val = the slot index, pos = arange(T) by default."""
    idx = torch.arange(T, device=device)
    return rule_mask(idx, idx if pos is None else pos, window)


@_sdpa_inputs
def swa_reference(q, k, v, window, pos=None):
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, pos, q.device))


@_v_seen_only
def _band(q, k, v, width, pos, val=None):
    """The rule over slots: val None (the slot index, width = window) or sorted r (width = delta); pos None: SWA."""
    backend = _backend(q)
    if backend == "reference":
        return masked_attention(q, k, v, rule_mask(val, pos, width) if val is not None else
                                swa_mask(q.shape[2], width, pos, q.device))
    if backend == "triton":
        import kernel
        try:  # the kernel checks itself at each rule's first use (kernel.check_once)
            return kernel.triton_swa(q, k, v, width, pos, val, VALUE_MARGIN)
        except kernel.CANNOT_RUN as e:
            if BACKEND == "triton":
                raise
            warnings.warn(f"the Triton kernel cannot run, using the torch path instead: {_why(e)}")
    return blocked.band(q, k, v, pos, val, width, VALUE_MARGIN)[0]


@_sdpa_inputs
def sliding_window_attention(q, k, v, window, pos=None):
    """SWA, with positions (the rule above): out (B, H, T, D) for q, k, v (B, H, T, D); pos a LongTensor (T,) or
    broadcastable to (B, H, T). Without pos, FlashAttention's window_size=(window-1, 0). Equals swa_reference."""
    return _band(q, k, v, check_positive(window), pos)


def sa_mask(window, perm):
    """SA's rank rule in ORIGINAL token order: val = each token's slot, pos = arange(T)."""
    return rule_mask(torch.argsort(perm, dim=-1), torch.arange(perm.shape[-1], device=perm.device), window)


@_sdpa_inputs
def sa_reference(q, k, v, window, perm):
    return masked_attention(q, k, v, sa_mask(window, perm))


def row_perms(seed, lengths, T, heads=1):
    """SA's permutations for right-padded rows: (B, heads, T), row b permuting only its first lengths[b] tokens,
    its pads keeping their slots after them. From `seed` and the row's length alone, never the rest of the batch."""
    rows = [torch.cat([torch.rand(heads, n, generator=torch.Generator().manual_seed(seed)).argsort(-1),  # (heads, n)
                       torch.arange(n, T).expand(heads, -1)], -1) for n in lengths.tolist()]          # (heads, T)
    return torch.stack(rows)                                                                           # (B, heads, T)


def gather(t, perm):
    """t (B, H, T, D) in slot order, slot s holding token perm[..., s]; perm (T,) or broadcastable to (B, H, T)."""
    if perm.dim() == 1:
        return t.index_select(2, perm)                                       # (B, H, T, D): the fast row copy
    b, h = (torch.arange(n, device=t.device) for n in t.shape[:2])           # (B,), (H,)
    return t[b[:, None, None], h[None, :, None], perm.expand(*t.shape[:3])]  # (B, H, T, D)


def scatter(ys, perm):
    """gather's inverse: ys (B, H, T, D) in slot order, back in token order."""
    return gather(ys, torch.argsort(perm, dim=-1))                           # (B, H, T, D)


@_sdpa_inputs
def stochastic_attention(q, k, v, window, perm):
    """SA by the rank rule (above), perm (T,) or broadcastable to (B, H, T): a query sees ~`window` keys, window >= T
    is full attention, the identity perm is SWA. Equals sa_reference. The last three lines are README.md's recipe."""
    _check_draw(perm, "perm", q)
    qs, ks, vs = gather(q, perm), gather(k, perm), gather(v, perm)  # gather into permuted order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)     # SWA there, causal on original positions
    return scatter(ys, perm)                                        # scatter back to token order


def sa_value_mask(delta, r):
    """SA's value rule in token order: val = r, width = delta, pos = arange(T)."""
    return rule_mask(r, torch.arange(r.shape[-1], device=r.device), delta)


@_sdpa_inputs
def sa_value_reference(q, k, v, delta, r):
    return masked_attention(q, k, v, sa_value_mask(delta, r))


@_sdpa_inputs
def stochastic_value_attention(q, k, v, delta, r):
    """SA by the value rule (above), r (T,) or broadcastable to (B, H, T): delta = window / T connects a pair as often
    as the rank rule. Sorted by r, a block of queries sees one contiguous key span. Equals sa_value_reference."""
    _check_draw(r, "r", q)
    if not 0 < delta:
        raise ValueError(f"delta must be > 0, got {delta!r}")
    perm = torch.argsort(r, dim=-1, stable=True)                       # (T,) or (B, H, T): ascending r
    ys = _band(gather(q, perm), gather(k, perm), gather(v, perm), delta, perm, r.gather(-1, perm).float())
    return scatter(ys, perm)                                           # (B, H, T, D) in token order


# -----------------------------------------------------------------------------
# MoBA: each query's own block plus the past blocks its router (blocked.moba_select) picks.

def moba_mask(q, k, moba_block, top_k):
    """MoBA's rule: (B, H, T, T) bool, True where query i sees key j: j <= i, in i's block or one moba_select picked."""
    T = q.shape[2]
    moba_block = min(moba_block, T)  # one block of T keys, or more: the same rule; memory follows T
    idx, ok = blocked.moba_select(q, k, moba_block, top_k)
    chosen = torch.zeros(*idx.shape[:3], math.ceil(T / moba_block), dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)                                         # (B, H, T, nblk)
    blk = torch.arange(T, device=q.device) // moba_block
    chosen[..., torch.arange(T), blk] = True                             # own block
    return chosen[..., blk] & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # (B, H, T, T): causal


@_sdpa_inputs
def moba_reference(q, k, v, moba_block, top_k):
    return masked_attention(q, k, v, moba_mask(q, k, moba_block, top_k))


@_sdpa_inputs
def moba_attention(q, k, v, moba_block, top_k):
    """MoBA (Mixture of Block Attention, the rule above): out (B, H, T, D). Equals moba_reference."""
    moba_block, top_k = min(check_positive(moba_block, "moba_block"), q.shape[2]), check_positive(top_k, "top_k")
    if _backend(q) == "reference":
        return moba_reference(q, k, v, moba_block, top_k)
    idx, ok = blocked.moba_select(q, k, moba_block, top_k)             # routed once, on the true q, k
    return _v_seen_only(lambda q, k, v: blocked.moba(q, k, v, idx, ok, moba_block)[0])(q, k, v)
