"""
Read first. Causal attention, q, k, v (B, H, T, D) -> (B, H, T, D), model.py's (B, nh, T, hs): full,
sliding-window (SWA), stochastic (SA) and MoBA. SWA and both SA rules are one rule over a slot and a
position per token:

    key j is visible to query i  iff  |slot[i] - slot[j]| < width  and  pos[j] <= pos[i]

SWA: slot = pos = the index, width = window: query i sees keys i - window + 1 ... i, itself
included. SA, the rank rule (the paper's): gather q, k, v by a random permutation perm (slot s holds
token perm[s]), run the window there with pos = perm (it reaches both ways over slots, and keeps the
earlier tokens), gather the output back: tokens a >= b interact iff their slots are less than
`window` apart. SA, the value rule: each token draws a number r in [0, 1), slot = r, width = delta:
a >= b interact iff |r_a - r_b| < delta, by r_a and r_b alone, so a KV cache decodes it. MoBA: query
i sees its own chunk (j <= i) and the moba_topk - 1 past chunks of largest q_i . mean(K_chunk).

Each kind's dense reference, O(T^2), is beside its fast function; the tests hold them equal, forward
and gradients. Each public function checks its inputs (guards.check_inputs); perm, pos and r are
(T,) or broadcastable to (B, H, T). Every query sees itself, and no query reads a key it may not
see, not even a NaN or inf in its k or v; but compiled, or in the Triton kernel, a non-finite v (and
compiled, k) may also make NaN its tile's other queries. Compiled, no perm or r is read either: the
kernel assumes perm a permutation and r in [0, 1), as the model's own draws are (model.sa_draw).
"""
import functools
import importlib.util
import math
import os
import time
import warnings

import torch
import torch.nn.functional as F

import moba
from guards import InputError, check_count, check_delta, check_inputs

# What runs SWA's and SA's band (train.py's attn_engine): "auto": the Triton kernel on a GPU where
# it passes its checks, else "torch", the torch code below; "triton": the kernel (on the CPU under
# TRITON_INTERPRET=1); "dense": a dense mask (rule_mask), for a debugger. Full attention is SDPA.
ATTN_ENGINE = "auto"
TILE = 128  # the torch engine's query rows per tile
# the value rule's key spans reach this far past delta: fp32 rounding of |r_i - r_j| (r < 1)
VALUE_MARGIN = 1e-6


# The dense reference: the rule as a T x T mask, and a softmax over the keys it shows.

def rule_mask(slot, pos, width):
    """THE rule, dense: (..., T, T) bool, True where query i may see key j; slot and pos (T,) or
    (..., T)."""
    near = (slot[..., :, None] - slot[..., None, :]).abs() < width  # (..., T, T)
    return near & (pos[..., None, :] <= pos[..., :, None])


def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D), keys hidden where mask is False) @ v, scores and softmax in fp32;
    keys may outnumber queries (a KV cache step). A non-finite v[j, d] reaches out[i, d] only where
    mask[i, j]."""
    q, k, v = check_inputs(q, k, v, any_length=True, mask=mask)
    with torch.autocast(q.device.type, enabled=False):
        scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
        # hidden: a weight of exactly 0
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        p = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H, T, S)
        bad = ~v.isfinite()  # (B, H, S, D)
        if not bad.any():
            return p @ v  # (B, H, T, D)
        seen = (mask.to(v.dtype) @ bad.to(v.dtype)) > 0  # (B, H, T, D): i sees a bad v[j, d]
        # 0 * NaN would reach every query
        return (p @ v.masked_fill(bad, 0)).masked_fill(seen, math.nan)


# Full attention.

def full_attention(q, k, v):
    """Causal attention by PyTorch's SDPA (its flash kernels where they run)."""
    q, k, v = check_inputs(q, k, v)
    if torch.compiler.is_compiling() or bool(v.isfinite().all()):  # compiled: not checked
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # SDPA weighs a hidden key 0, and 0 * NaN = NaN: each bad v[j, d] is set to 0, then out[i, d]
    # to NaN where query i sees key j (SDPA with q = k = 0 weighs each key it sees >= 1/T)
    bad = ~v.isfinite()  # (B, H, T, D)
    zero_q, zero_k = torch.zeros_like(q), torch.zeros_like(k)
    seen = F.scaled_dot_product_attention(zero_q, zero_k, bad.to(v.dtype), is_causal=True) > 0
    y = F.scaled_dot_product_attention(q, k, v.masked_fill(bad, 0), is_causal=True)
    return y.masked_fill(seen, math.nan)  # (B, H, T, D)


def full_reference(q, k, v):
    T = q.shape[2]
    return masked_attention(q, k, v, torch.ones(T, T, dtype=torch.bool, device=q.device).tril())


# SWA, and both SA rules through it.

def sliding_window_attention(q, k, v, window, pos=None, r=None):
    """SWA by the rule above, in O(T * window): slot = the index, pos = arange(T) unless given
    (then the window reaches both ways over slots, causal on pos). Equals swa_reference. With r
    (ascending; SA's value rule), slot = r and window is the width delta: sa_value_reference's
    rule, in the slot order r sorts."""
    two_sided = pos is not None  # SA's: the window reaches both ways, causal on pos
    rule_args = dict(window=window) if r is None else dict(delta=window, r=r)
    q, k, v = check_inputs(q, k, v, pos=pos, **rule_args)
    engine = "torch"  # the CPU's; on a GPU, or by ATTN_ENGINE, what _engine (below) picks
    if q.device.type in KERNEL_DEVICES or ATTN_ENGINE != "auto":
        engine = _engine(q, "swa" if pos is None and r is None else "")
    if engine == "triton" and q.numel():
        return _kernel(q, k, v, float(window))
    (B, H, T, D), dev = q.shape, q.device
    idx = torch.arange(T, device=dev)
    pos = idx if pos is None else pos  # (T,) or (B, H, T)
    slot = idx if r is None else r
    width = min(window, T) if r is None else window  # a window past T is T: no int64 overflow
    if engine == "dense" or q.numel() == 0:
        return masked_attention(q, k, v, rule_mask(slot, pos, width))
    if r is not None and torch.compiler.is_compiling():  # nk is read from r: an op (below)
        return _value_band(q, k, v, window, pos, r)
    # Queries in tiles of nq slots; a tile's keys are the nk slots its queries' windows can reach.
    # The last tile's qpad slots past T - 1 are padding.
    nq = min(TILE, T)
    nt = math.ceil(T / nq)  # tiles
    qpad = nt * nq - T
    qs = F.pad(q, (0, 0, 0, qpad)).reshape(B, H, nt, nq, D)  # (B, H, nt, nq, D): the query tiles
    qpos = F.pad(pos, (0, qpad), value=T).unflatten(-1, (nt, nq))  # (..., nt, nq)
    if r is None:  # query i's window: slots i - before ... i + after, views of padded k and v
        before, after = width - 1, width - 1 if two_sided else 0
        nk = before + nq + after
        kp = F.pad(k, (0, 0, before, qpad + after))  # (B, H, before + nt * nq + after, D)
        vp = F.pad(v, (0, 0, before, qpad + after))
        ks = kp.unfold(2, nk, nq).transpose(-1, -2)  # (B, H, nt, nk, D)
        vs = vp.unfold(2, nk, nq).transpose(-1, -2)
        kpos = F.pad(pos, (before, qpad + after), value=T + 1).unfold(-1, nk, nq)  # (..., nt, nk)
        gap = torch.arange(nq, device=dev)[:, None] + before - torch.arange(nk, device=dev)
        near = gap.abs() < width  # (nq, nk): query slot minus key slot, the same in every tile
    else:  # the slots whose r lies within delta of the tile's least or greatest r, as copies
        first = torch.arange(nt, device=dev) * nq  # (nt,): each tile's first slot
        start, nk = value_spans(r, width, first, (first + nq).clamp(max=T) - 1)  # (..., nt), an int
        kslot = start[..., None] + torch.arange(nk, device=dev)  # (..., nt, nk)
        pad = kslot >= T  # padding keys, past T - 1
        kslot = kslot.clamp(max=T - 1)
        at = kslot.expand(B, H, nt, nk).reshape(B, H, nt * nk, 1).expand(-1, -1, -1, D)
        ks = k.gather(2, at).view(B, H, nt, nk, D)  # (B, H, nt, nk, D)
        vs = v.gather(2, at).view(B, H, nt, nk, D)
        kpos = pos.gather(-1, kslot.expand(*pos.shape[:-1], nt, nk).flatten(-2))  # (..., nt * nk)
        kpos = kpos.unflatten(-1, (nt, nk)).masked_fill(pad, T + 1)  # (..., nt, nk)
        kr = r.gather(-1, kslot.flatten(-2)).view(kslot.shape)  # (..., nt, nk): the keys' r
        qr = F.pad(r, (0, qpad)).unflatten(-1, (nt, nq))  # (..., nt, nq): the queries' r
        near = (qr[..., :, None] - kr[..., None, :]).abs() < width
    # The rule on each tile, (..., nt, nq, nk). Padding keys (pos T + 1) are hidden from every
    # query; padding queries see their tile's every key, so that no row is all hidden.
    mask = near & (kpos[..., None, :] <= qpos[..., :, None])
    if qpad:
        mask[..., -1, nq - qpad:, :] = True
    mask = mask.expand(B, H, nt, nq, nk).flatten(0, 1) if mask.dim() == 5 else mask[None]
    qs, ks, vs = qs.flatten(0, 1), ks.flatten(0, 1), vs.flatten(0, 1)  # (B * H, nt, rows, D)
    finite = torch.compiler.is_compiling() or bool((k.sum() + v.sum()).isfinite())  # compiled: skip
    if finite:  # the tiles as SDPA's heads: softmax(q k^T / sqrt(D), hidden keys -inf) @ v, fused
        y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # (B * H, nt, nq, D)
    else:  # the same softmax written out: a NaN or inf reaches only the queries that see it
        y = masked_attention(qs, ks, vs, mask)
    return y.view(B, H, nt * nq, D)[:, :, :T]  # (B, H, T, D)


def value_spans(r, delta, first, last):
    """The value rule's key spans for the query tiles of slots first[t] ... last[t]: (start, nk),
    key slots start[..., t] ... start[..., t] + nk - 1 hold every key within delta (plus
    VALUE_MARGIN: fp32 rounding) of the tile's queries, and its own; r (T,) or (B, H, T), ascending."""
    start = torch.searchsorted(r, r[..., first] - delta - VALUE_MARGIN)  # (..., nt)
    end = torch.searchsorted(r, r[..., last] + delta + VALUE_MARGIN).maximum(last + 1)
    return start, int((end - start).max())  # the longest span: every tile's, padded


def swa_mask(T, window, pos=None, device=None):
    """SWA's rule in slot order: slot = the index, pos = arange(T) by default."""
    idx = torch.arange(T, device=device)
    width = min(check_count(window, "window"), T)  # a window past T is T: no int64 overflow
    return rule_mask(idx, idx if pos is None else pos, width)


def swa_reference(q, k, v, window, pos=None):
    check_inputs(q, k, v, window=window, pos=pos)
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, pos, q.device))


def gather(t, perm):
    """t (B, H, T, D) in slot order: slot s holds token perm[..., s] (perm.argsort(-1): back)."""
    if perm.dim() == 1:
        return t.index_select(2, perm)  # (B, H, T, D)
    return t.gather(2, perm.expand(*t.shape[:3])[..., None].expand(t.shape))  # (B, H, T, D)


def stochastic_attention(q, k, v, window, perm):
    """SA by the rank rule: a query sees `window` keys on average over the sequence (query i about
    1 + 2 (window - 1) i / T); window >= T is full attention. Equals sa_reference. Its last three
    lines are README.md's recipe."""
    q, k, v = check_inputs(q, k, v, window=window, perm=perm)
    maybe_kernel = q.device.type in KERNEL_DEVICES or ATTN_ENGINE != "auto"  # a GPU, or an engine chosen
    if maybe_kernel and q.numel() and _engine(q, "sa rank") == "triton":
        return _kernel(q, k, v, float(window), perm)  # the three lines below, in one launch
    qs, ks, vs = gather(q, perm), gather(k, perm), gather(v, perm)  # (B, H, T, D) each, in permuted (slot) order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)     # SWA there, both ways, causal on true positions
    return gather(ys, perm.argsort(-1))                             # back to token order: gather by perm's inverse


def sa_mask(window, perm):
    """SA's rank rule in token order: slot = each token's slot (perm's inverse), pos = arange(T)."""
    T = perm.shape[-1]
    width = min(check_count(window, "window"), T)
    return rule_mask(perm.argsort(-1), torch.arange(T, device=perm.device), width)


def sa_reference(q, k, v, window, perm):
    check_inputs(q, k, v, window=window, perm=perm)
    return masked_attention(q, k, v, sa_mask(window, perm))


def stochastic_value_attention(q, k, v, delta, r):
    """SA by the value rule: a pair meets with probability 2 delta - delta^2, as by the rank rule at
    T = window / delta (the model's delta: window / block_size). Sorted by r, a tile of queries sees
    one run of keys. Equals sa_value_reference."""
    q, k, v = check_inputs(q, k, v, delta=delta, r=r)
    r_sorted, perm = torch.sort(r, dim=-1, stable=True)  # each slot's r, ascending, and its token
    maybe_kernel = q.device.type in KERNEL_DEVICES or ATTN_ENGINE != "auto"  # a GPU, or an engine chosen
    if maybe_kernel and q.numel() and _engine(q, "sa value") == "triton":
        return _kernel(q, k, v, float(delta), perm, r_sorted.float(), VALUE_MARGIN)  # one launch
    qs, ks, vs = gather(q, perm), gather(k, perm), gather(v, perm)  # (B, H, T, D) each, sorted by r
    ys = sliding_window_attention(qs, ks, vs, delta, pos=perm, r=r_sorted)  # |r_i - r_j| < delta
    return gather(ys, perm.argsort(-1))  # (B, H, T, D): back to token order


def sa_value_mask(delta, r):
    """SA's value rule in token order: slot = r, width = delta, pos = arange(T)."""
    return rule_mask(r, torch.arange(r.shape[-1], device=r.device), check_delta(delta))


def sa_value_reference(q, k, v, delta, r):
    check_inputs(q, k, v, delta=delta, r=r)
    return masked_attention(q, k, v, sa_value_mask(delta, r))


# MoBA: each query's own chunk plus the past chunks moba.moba_select picks.

def moba_attention(q, k, v, moba_chunk, moba_topk):
    """MoBA (Mixture of Block Attention; its blocks are our chunks), on moba.py's engine. Equals
    moba_reference."""
    q, k, v = check_inputs(q, k, v, moba_chunk=moba_chunk, moba_topk=moba_topk)
    # a chunk of T keys or more: the same rule, in memory of T
    moba_chunk = max(1, min(int(moba_chunk), q.shape[2]))
    idx, ok = moba.moba_select(q, k, moba_chunk, int(moba_topk))  # routed once, on the true q, k
    return moba.attention(q, k, v, idx, ok, moba_chunk)


def moba_mask(q, k, moba_chunk, moba_topk):
    """MoBA's rule: (B, H, T, T) bool, True where query i sees key j: j <= i, in i's chunk or one
    moba_select picked."""
    T, moba_topk = q.shape[2], check_count(moba_topk, "moba_topk")
    # a chunk of T keys or more: the same rule
    moba_chunk = max(1, min(check_count(moba_chunk, "moba_chunk"), T))
    idx, ok = moba.moba_select(q, k, moba_chunk, moba_topk)
    nc = math.ceil(T / moba_chunk)  # chunks
    chosen = torch.zeros(*idx.shape[:3], nc, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)  # (B, H, T, nchunks)
    chunk = torch.arange(T, device=q.device) // moba_chunk
    chosen[..., torch.arange(T), chunk] = True  # own chunk
    # (B, H, T, T): causal
    return chosen[..., chunk] & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()


def moba_reference(q, k, v, moba_chunk, moba_topk):
    q, k, v = check_inputs(q, k, v, moba_chunk=moba_chunk, moba_topk=moba_topk)
    return masked_attention(q, k, v, moba_mask(q, k, moba_chunk, moba_topk))


# -----------------------------------------------------------------------------
# Support, which a first reading skips: which engine runs the band.

def _kernel(q, k, v, *args):
    import kernel
    return kernel.triton_swa(q, k, v, *args)


def _engine(q, rule):
    """What runs q's band by ATTN_ENGINE: "triton" (the kernel, for rule "swa", "sa rank", "sa value";
    "" or None: none, e.g. SWA over a given pos), "torch" or "dense"."""
    if ATTN_ENGINE not in ("auto", "torch", "triton", "dense"):
        raise InputError(f"attention.ATTN_ENGINE must be auto, torch, triton or dense, not {ATTN_ENGINE!r}")
    if ATTN_ENGINE == "triton" and rule:
        if not _has_triton():
            raise InputError("attn_engine 'triton' needs the triton package (pip install triton); "
                             "'auto' or 'torch' runs without it")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise InputError(f"attn_engine 'triton' runs the Triton kernel on a CUDA GPU, not on "
                             f"{q.device} (or on the CPU under TRITON_INTERPRET=1, for tests): use "
                             "attn_engine 'auto' or 'torch'")
        return "triton"
    H, T, D = q.shape[1:]
    small = H * T * D < 2**31  # the kernel's int32 offsets
    if ATTN_ENGINE == "auto" and rule and small and _kernel_ok(q.device, q.dtype, D, rule):
        return "triton"
    return "dense" if ATTN_ENGINE == "dense" else "torch"


# torch.compile cannot trace the value rule's torch band, whose nk is read from r: it calls this op
# instead, which runs sliding_window_attention eagerly (its backward recomputes and differentiates)

def _band(q, k, v, delta, pos, r):
    return sliding_window_attention(q, k, v, delta, pos, r).contiguous()


def _band_vjp(dy, q, k, v, delta, pos, r):
    return list(torch.func.vjp(lambda q, k, v: _band(q, k, v, delta, pos, r), q, k, v)[1](dy))


QKV = "Tensor q, Tensor k, Tensor v, float delta, Tensor pos, Tensor r"
_value_band = torch.library.custom_op("sa::value_band", _band, mutates_args=(),
                                      schema=f"({QKV}) -> Tensor")
_value_band_vjp = torch.library.custom_op("sa::value_band_vjp", _band_vjp, mutates_args=(),
                                          schema=f"(Tensor dy, {QKV}) -> Tensor[]")
_value_band.register_fake(lambda q, *_: torch.empty_like(q))
_value_band_vjp.register_fake(lambda dy, q, k, v, *_: [torch.empty_like(t) for t in (q, k, v)])
_value_band.register_autograd(
    lambda ctx, dy: (*_value_band_vjp(dy, *ctx.saved_tensors[:3], ctx.delta, *ctx.saved_tensors[3:]),
                     None, None, None),
    setup_context=lambda ctx, inputs, output: (ctx.save_for_backward(*inputs[:3], *inputs[4:]),
                                               setattr(ctx, "delta", inputs[3])))


KERNEL_DEVICES = ("cuda",)  # where "auto" may run the kernel (a test adds "cpu": the interpreter)
TRITON_VERSIONS = ((3, 2), (3, 9))  # Triton minors tested: results/kernel_triton_versions.txt


@torch.compiler.assume_constant_result  # decided before tracing: no compiled graph holds a refusal
def _kernel_ok(device, dtype, D, rule):
    """Whether "auto" runs the kernel (_refusal); one warning where it failed a check."""
    why = _refusal(device, dtype, D, rule)
    if why:
        warnings.warn(f"the Triton kernel cannot run, using the torch engine instead: {why}")
    return why is None


def _refusal(device, dtype, D, rule):
    """None where "auto" runs the kernel (kernel.check_once checks the GPU, the head dim and dtype,
    then self-checks at the first use); else "" (not tried: not a GPU, or no supported Triton), or
    why not, in one line."""
    if device.type not in KERNEL_DEVICES or not _has_triton() or not _triton_supported():
        return ""
    import kernel
    try:
        kernel.check_once(device, dtype, D, rule, VALUE_MARGIN)
    except kernel.CANNOT_RUN as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    return None


@torch.compiler.assume_constant_result  # a constant to torch.compile (Dynamo breaks at find_spec)
def _has_triton():
    return importlib.util.find_spec("triton") is not None


@functools.cache  # read once (Dynamo never traces it: _kernel_ok is a constant)
def _triton_supported():
    """Whether Triton is installed and in TRITON_VERSIONS (outside them: one warning)."""
    import triton  # installed: _has_triton
    if TRITON_VERSIONS[0] <= tuple(map(int, triton.__version__.split(".")[:2])) <= TRITON_VERSIONS[1]:
        return True
    warnings.warn(f"Triton {triton.__version__} is outside the tested range {TRITON_VERSIONS}: "
                  "using the torch engine")
    return False


def engine_line(device, dtype, head_dim, kinds, sa_rule="rank"):
    """The line train.py, sample.py and eval.py print: what runs the SWA and SA of kinds (a list, or
    one) in dtype on device. On a GPU, the kernel's checks of each rule run now, before training."""
    q = torch.empty(0, 0, 0, head_dim, device=device, dtype=dtype)
    kinds = {kinds} if isinstance(kinds, str) else set(kinds)
    users = {"swa": {"swa", "sa+swa"}, "sa " + sa_rule: {"sa", "sa+swa"}}  # each kernel rule's kinds
    rules = [rule for rule, kinds_of_rule in users.items() if kinds_of_rule & kinds]
    engine, start = _engine(q, None), time.perf_counter()  # None: "torch" or "dense"
    auto = ATTN_ENGINE == "auto"
    why = {rule: _refusal(q.device, dtype, head_dim, rule) for rule in rules} if auto else {}
    if not rules or ATTN_ENGINE not in ("auto", "triton") or "" in why.values():  # "": not tried
        return f"attention: {f'the {engine} engine' if rules else 'no SWA or SA'} on {q.device}"
    if ATTN_ENGINE == "triton":
        _engine(q, rules[0])  # its one-line refusals, before triton is imported
    import kernel
    for rule in rules if ATTN_ENGINE == "triton" else ():
        try:
            kernel.check_once(q.device, dtype, head_dim, rule, VALUE_MARGIN)
        except kernel.CANNOT_RUN as e:  # the kernel cannot run this case here: one line
            reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            raise InputError(f"attn_engine 'triton': {reason} ('auto' takes the torch engine)") from None
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
