"""
Causal attention functions: full, sliding-window (SWA), stochastic (SA) and MoBA.

Every function takes q, k, v of shape (B, H, T, D) and returns (B, H, T, D).

THE RULES (stated once; the dense references, the blocked torch path and the
Triton kernel in kernel.py all follow them, and test_attention.py checks that).
SWA and both SA rules are one rule over a value and a position per token:

  key j is visible to query i  iff  |val[i] - val[j]| < width  and  pos[j] <= pos[i]

  sliding_window_attention(q, k, v, window, pos):
      val = the slot index, width = window. pos is a LongTensor of shape (T,) or
      one broadcastable to (B, H, T); it defaults to arange(T). With the default,
      that is plain causal SWA, i - window < j <= i: `window` keys including
      itself (FlashAttention's window_size=(window-1, 0)). With pos given, the
      band reaches window-1 slots on BOTH sides and causality acts on pos, not
      on the slot index.

  stochastic_attention(q, k, v, window, perm)            (the rank rule, the paper's)
      perm is a permutation of range(T), shape (T,) or (B, H, T); slot s of the
      permuted sequence holds original token perm[s]. Gather q, k, v by perm,
      run sliding_window_attention(..., window, pos=perm) and scatter the output
      back. So tokens a and b (a >= b) interact iff their slots are fewer than
      `window` apart: no token ever sees its future, a query sees about
      `window` keys on average, window >= T gives full attention for any perm,
      and the identity perm gives SWA.

  stochastic_value_attention(q, k, v, delta, r)          (the value rule)
      r holds one i.i.d. uniform key in [0, 1) per token, shape (T,) or (B, H, T):
      val = r, width = delta, pos = the token index. Tokens a >= b interact iff
      |r_a - r_b| < delta. With delta = window / T a pair is connected with the
      same probability as under the rank rule, but visibility depends on r_a and
      r_b alone, never on the other tokens: a KV cache can decode it exactly
      (model.py). Sorted by r, a block of queries sees one contiguous span of keys.

  moba_attention(q, k, v, block_size, top_k):
      keys are split into blocks of block_size. Query i always attends to its
      own block (causally, j <= i) plus the top_k - 1 strictly-past blocks with
      the largest q_i . mean(K_block) (scored in fp32). top_k * block_size >= T
      gives full attention.

Every query sees at least itself, so no row is ever fully masked. Scores and
softmax are computed in fp32 for every input dtype (fp16 overflows no sooner
than in PyTorch's SDPA). Speed and memory on the CPU: python bench.py.
"""
import importlib.util
import math

import torch
import torch.nn.functional as F

# The one switch: which implementation the fast functions below run.
#   "auto":      the Triton kernel (kernel.py) for CUDA tensors with a head dim it supports,
#                the blocked torch path otherwise
#   "torch":     the blocked torch path: O(T * window) time and memory, no T x T tensor, forward and backward
#   "triton":    the Triton kernel (also runs on the CPU under TRITON_INTERPRET=1)
#   "reference": the dense-mask O(T^2) oracle
BACKEND = "auto"
BACKENDS = ("auto", "torch", "triton", "reference")
BLOCK = 64        # query rows per block in the blocked torch path
CHUNK = 1 << 19   # score elements per step of the blocked torch path: a chunk's scores stay in cache
NEG = float("-inf")  # the blocked path's additive masks hide with -inf (exp is fast there; no row is all -inf)
VALUE_MARGIN = 1e-6  # the value rule's spans reach this much past delta, so rounding never drops a visible key


def check_positive(value, name="window"):
    """value, if it is an integer >= 1 (a window, a block size, ...); else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_draw(draw, name, B, H, T):
    """SA's draw (a permutation `perm`, or value keys `r`): of shape (T,) or broadcastable to (B, H, T)."""
    kind, ok = ("a LongTensor", draw.dtype == torch.long) if name == "perm" else ("a float tensor", draw.is_floating_point())
    if not ok or draw.shape[-1] != T or draw.dim() not in (1, 3):
        raise ValueError(f"{name} must be {kind} of shape (T,) or (B, H, T) with T={T}, "
                         f"got {draw.dtype} {tuple(draw.shape)}")
    if draw.dim() == 3 and draw.shape[:2] not in ((B, H), (1, H), (B, 1), (1, 1)):
        raise ValueError(f"{name} of shape {tuple(draw.shape)} does not broadcast to (B, H, T)=({B}, {H}, {T})")


def _kernel(q, k, v, width, pos, val=None):
    """kernel.triton_swa, or None where BACKEND="auto" finds that it cannot run on this GPU (see
    kernel.choose_config): then a one-line warning, and the caller takes the torch path, not a crash."""
    import kernel
    try:
        return kernel.triton_swa(q, k, v, width, pos, val)
    except Exception as e:
        if BACKEND == "triton":
            raise
        import warnings
        cause = (str(e).strip().splitlines() or [""])[0]
        warnings.warn(f"the Triton kernel failed, using the torch path instead: {type(e).__name__}: {cause}")


def _backend(q):
    if BACKEND not in BACKENDS:
        raise ValueError(f"attention.BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
    if BACKEND == "auto":
        if not q.is_cuda or importlib.util.find_spec("triton") is None:
            return "torch"
        import kernel
        return "triton" if q.shape[-1] in kernel.HEAD_DIMS and q.dtype in kernel.DTYPES else "torch"
    return BACKEND


# -----------------------------------------------------------------------------
# The dense references: obviously correct, O(T^2), the oracle for every test. Each
# kind's mask (the rule, written directly) sits next to its fast path below.

def full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D) where mask else -inf) @ v, the scores and softmax in fp32 (no fp16 overflow)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v                          # (B, H, T, D)


# -----------------------------------------------------------------------------
# The blocked torch path: O(T * window) time and memory, forward and backward.
#
# One engine serves SWA, SA and MoBA. A kind is a layout: it yields chunks of GROUPS, a group
# being C query rows, the L key rows they may see and an additive mask (C, L) of 0 or -inf that
# applies the rule. Rows index q, k, v flattened to (B*H*T + 1, D), the extra last row zeros
# (what padding reads), or, if the layout has an `order`, a copy laid out in that order with
# zero pad slots: the band lays its slots out once, so that its key spans are overlapping
# strided VIEWS of one copy (layout.take) instead of gathers. A chunk's scores stay in cache;
# a query in several groups (MoBA) gets one softmax over all of them, merged by logsumexp as
# FlashAttention merges its blocks. The
# backward recomputes each chunk's probabilities from the saved logsumexp, so nothing of size
# T * window is kept between the passes and autograd never sees the chunk loop.

def _flat(t, layout):
    """(B, H, T, D) -> (N, D) in fp32 (scores in fp32: fp16 cannot overflow): the rows in
    layout.order, its pad slots zero; without an order, (B*H*T + 1, D), the last row zero."""
    f = t.detach().float().flatten(0, 2)                                 # (B*H*T, D)
    if layout.order is None:
        return F.pad(f, (0, 0, 0, 1))
    return f.index_select(0, layout.order).index_fill_(0, layout.pads, 0)  # one pass, pads included


def _unflat(f, layout, like):
    """_flat undone: f (N, D) back to the shape and dtype of `like` (B, H, T, D)."""
    if layout.order is not None:  # each token is written once; the pad slots go to a dropped last row
        n = like[:, :, :, 0].numel()
        f = f.new_empty(n + 1, f.shape[-1]).index_copy_(0, layout.order.index_fill(0, layout.pads, n), f)
    return f[:-1].view(like.shape).to(like.dtype)


def _gather(t, rows):
    """t (N, D) at rows (...) -> (..., D); index_select is several times faster than t[rows]."""
    return t.index_select(0, rows.flatten()).view(*rows.shape, t.shape[-1])


def _view(t, rows):
    """_gather for rows that are a strided view of arange(N) (rows[i] sits at storage offset i):
    the same strided view of t (N, D), without a copy."""
    return t.as_strided((*rows.shape, t.shape[-1]), (*(st * t.shape[-1] for st in rows.stride()), 1),
                        rows.storage_offset() * t.shape[-1])


class _GroupedAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, layout):
        D, take = q.shape[-1], layout.take
        qf, kf, vf = _flat(q, layout).div_(math.sqrt(D)), _flat(k, layout), _flat(v, layout)  # (N, D)
        # Each query's softmax over all the groups it is in: SWA and SA put a query in exactly one
        # group, MoBA in several, merged online as FlashAttention merges its key blocks: the
        # largest logsumexp so far (top), the sum of exp(lse - top) (total) and the output sum.
        top = torch.full_like(qf[:, 0], NEG)                                # (N,)
        # (one group per query: every query row is written once; the rows no query owns stay unread)
        total, out = torch.zeros_like(top), torch.zeros_like(qf) if layout.merge else torch.empty_like(qf)
        for qrows, krows, mask in layout():                                 # (..., C), (..., L), (..., C, L)
            qc, kc, vc = take(qf, qrows), take(kf, krows), take(vf, krows)     # (..., C|L, D)
            s = (qc @ kc.transpose(-1, -2)).add_(mask)                      # (..., C, L)
            m = s.amax(-1, keepdim=True)                                    # (..., C, 1)
            p = s.sub_(m).exp_()                                            # (..., C, L), unnormalised
            l = p.sum(-1, keepdim=True)                                     # (..., C, 1)
            rows, lse = qrows.flatten(), (m + l.log()).flatten()            # (n,): this chunk's group rows
            if not layout.merge:
                out.index_copy_(0, rows, (p @ vc).div_(l).flatten(0, -2))
                top.index_copy_(0, rows, lse)
                continue
            seen = rows.unique()                                            # a row may be in several groups
            old = top[seen]
            top.scatter_reduce_(0, rows, lse, "amax")
            rescale = (old - top[seen]).exp_()                              # earlier groups, to the new max
            total[seen] *= rescale
            out[seen] *= rescale[:, None]
            w = (lse - top[rows]).exp_()                                    # (n,)
            total.index_add_(0, rows, w)
            out.index_add_(0, rows, (p @ vc).mul_((w / l.flatten()).view_as(l)).flatten(0, -2))
        if layout.merge:
            out /= total[:, None]
            top += total.log()                                              # the logsumexp of each row
        ctx.save_for_backward(q, k, v, out, top)
        ctx.layout = layout
        return _unflat(out, layout, q)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, D = ctx.layout, q.shape[-1]
        take = layout.take
        qf, kf, vf, dof = _flat(q, layout).div_(math.sqrt(D)), _flat(k, layout), _flat(v, layout), _flat(dout, layout)
        delta = (dof * out).sum(-1)                                         # (N,): rowsum(dO * O)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        for qrows, krows, mask in layout():
            qc, doc, kc, vc = take(qf, qrows), take(dof, qrows), take(kf, krows), take(vf, krows)
            p = (qc @ kc.transpose(-1, -2)).add_(mask).sub_(lse[qrows][..., None]).exp_()  # (..., C, L)
            dv.index_add_(0, krows.flatten(), (p.transpose(-1, -2) @ doc).flatten(0, -2))
            dp = doc @ vc.transpose(-1, -2)                                 # (..., C, L)
            ds = p.mul_(dp.sub_(delta[qrows][..., None]))                   # (..., C, L): dloss/dscores
            dq.index_add_(0, qrows.flatten(), (ds @ kc).flatten(0, -2))
            dk.index_add_(0, krows.flatten(), (ds.transpose(-1, -2) @ qc).flatten(0, -2))
        dq /= math.sqrt(D)
        return *(_unflat(g, layout, t) for g, t in ((dq, q), (dk, k), (dv, v))), None


# -----------------------------------------------------------------------------
# SWA, and both SA rules through it: the band.

def rule_mask(val, pos, width):
    """THE rule, dense: (..., T, T) bool, True where query i may see key j:
    |val[i] - val[j]| < width and pos[j] <= pos[i]; val and pos of shape (T,) or (..., T)."""
    near = (val[..., :, None] - val[..., None, :]).abs() < width         # (..., T, T)
    return near & (pos[..., None, :] <= pos[..., :, None])


def swa_mask(T, window, pos=None, device=None):
    """SWA's mask in slot order: val = the slot index, pos = arange(T) by default."""
    idx = torch.arange(T, device=device)
    return rule_mask(idx, idx if pos is None else pos, window)


def swa_reference(q, k, v, window, pos=None):
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, pos, q.device))


def _band_layout(B, H, T, width, idx, pos, val=None, two_sided=True):
    """Slot s holds row idx[s] of q, k, v, with position pos[s] and value val[s] (SWA: idx = pos =
    arange(T); rank SA: idx = pos = perm; value SA: idx = pos = argsort(r), val = r ascending).
    The engine lays q, k, v out in slot order once (`order`, pads included), and query block b
    (C slots) sees a span of L slots:
    - val None (the slot index): the band, C + left + right slots around the block, the same for
      every block, so the spans are strided views of the copy and |slot difference| < width is one
      (C, L) mask;
    - val given (sorted): block b's span starts at the first slot within width of the block's
      smallest val (searchsorted) and has L slots, the longest any block needs; the rule's mask is
      computed per block. Extra keys in a span are masked, so a loose bound is safe.
    Pad slots are zeros, with a pos in everyone's future and (val) a value far from every real one."""
    BH, device = B * H, idx.device
    C = min(BLOCK, 1 << (T - 1).bit_length())          # block rows; small T needs no full block
    nb = math.ceil(T / C)
    first = torch.arange(nb, device=device) * C        # each block's first slot
    if val is None:
        w = min(width, T)                              # |i - j| < T always holds
        left, right = w - 1, (w - 1 if two_sided else 0)   # the band's reach in slots
        L = C + left + right
    else:
        val = val.expand(B, H, T).reshape(BH, T) if val.dim() == 3 else val[None]  # (BH or 1, T), ascending
        # margin: fp32 rounding of |val_i - val_j| near width (ulps < 1.2e-7 for r in [0, 1))
        start = torch.searchsorted(val, val[:, first] - width - 1e-6)                  # (BH or 1, nb)
        end = torch.searchsorted(val, val[:, (first + C).clamp(max=T) - 1] + width + 1e-6)
        L = int((torch.maximum(end, first + C) - start).max())  # the block's own slots always in its span
        left, right = 0, L - C
    pad = (left, nb * C - T + right)
    order = idx.expand(B, H, T).reshape(BH, T) + torch.arange(BH, device=device)[:, None] * T  # (BH, T)
    order = F.pad(order, pad, value=-1).flatten()                             # (BH*S,), S = left+Tp+right; pads -1
    pads = (order < 0).nonzero().flatten()                                    # (P,): the pad slots
    rows = torch.arange(order.numel(), device=device).view(BH, -1)            # (BH, S): rows of the copy
    pos = pos.expand(B, H, T).reshape(BH, T) if pos.dim() == 3 else pos[None]  # (BH or 1, T)
    big = pos.new_full((pos.shape[0], 1), torch.iinfo(torch.long).max)
    pos = torch.cat([big.expand(-1, pad[0]), pos, big.expand(-1, pad[1])], 1)  # (BH or 1, S)
    if val is None:
        r, c = torch.arange(C, device=device), torch.arange(L, device=device)
        outside = (r[:, None] + left - c[None, :]).abs() >= w                # (C, L): the same for every block
        band = torch.zeros(C, L, device=device).masked_fill_(outside, NEG)   # (C, L) additive
    else:
        val = F.pad(val, (0, pad[1]), value=1e30)                             # (BH or 1, S)
        kslots = start[..., None] + torch.arange(L, device=device)            # (BH or 1, nb, L)
    n = min(nb, max(1, CHUNK // (C * L)))     # blocks per chunk
    m = max(1, CHUNK // (C * L * nb))         # heads per chunk, when one head's blocks all fit

    def spans(t, h, s, e):
        """t (BH or 1, S) at the key slots of blocks s..e-1, heads h..h+m-1: (m or 1, e-s, L)."""
        if val is None:
            return t[h:h + m, s * C:(e - 1) * C + L].unfold(1, L, C)             # a strided view
        t, ks = t[h:h + m], kslots[h:h + m] if len(kslots) > 1 else kslots
        return t.gather(1, ks[:, s:e].flatten(1).expand(len(t), -1)).view(len(t), e - s, L)

    def chunks():  # one head at a time, if T is long: then the spans are views a matmul takes as they are
        for s in range(0, nb, n):
            e = min(s + n, nb)
            for h in range(0, BH, m):
                if h == 0 or len(pos) > 1:  # a pos shared by the heads makes one mask for all of them
                    qpos = pos[h:h + m, left + s * C:left + e * C].unflatten(1, (e - s, C))  # (m or 1, n, C)
                    visible = spans(pos, h, s, e)[..., None, :] <= qpos[..., :, None]      # (m or 1, n, C, L)
                    if val is None:
                        mask = torch.where(visible, band, NEG)
                    else:
                        qval = val[h:h + m, s * C:e * C].unflatten(1, (e - s, C))         # (m or 1, n, C)
                        visible &= (qval[..., :, None] - spans(val, h, s, e)[..., None, :]).abs() < width
                        mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, NEG)
                qrows = rows[h:h + m, left + s * C:left + e * C].unflatten(1, (e - s, C))     # (m, n, C)
                yield qrows, spans(rows, h, s, e), mask                                       # .., (m, n, L)
    chunks.merge = False  # every query is in one group
    chunks.order, chunks.pads = order.clamp_(min=0), pads  # pads read any row; _flat zeroes them
    chunks.take = _view if val is None else _gather  # band: rows and spans are strided views of the copy
    return chunks


def sliding_window_attention(q, k, v, window, pos=None):
    """Causal sliding-window attention, with positions: out (B, H, T, D) for q, k, v (B, H, T, D);
    key j is visible to query i iff |i - j| < window and pos[j] <= pos[i], pos (T,) or broadcastable
    to (B, H, T), default arange(T): plain SWA over the last `window` keys. Equals swa_reference."""
    check_positive(window)
    backend = _backend(q)
    if backend == "reference":
        return swa_reference(q, k, v, window, pos)
    if backend == "triton" and (out := _kernel(q, k, v, window, pos)) is not None:
        return out
    B, H, T, D = q.shape
    idx = torch.arange(T, device=q.device)
    return _GroupedAttention.apply(q, k, v, _band_layout(B, H, T, window, idx, idx if pos is None else pos,
                                                         two_sided=pos is not None))


def sa_mask(window, perm):
    """SA's rank rule in ORIGINAL token order: val = each token's slot, pos = arange(T)."""
    return rule_mask(torch.argsort(perm, dim=-1), torch.arange(perm.shape[-1], device=perm.device), window)


def sa_reference(q, k, v, window, perm):
    return masked_attention(q, k, v, sa_mask(window, perm))


def _take(t, idx):
    """t (B, H, T, D) with its rows in idx's order, idx of shape (T,) or (B, H, T):
    out[b, h, s] = t[b, h, idx[b, h, s]]. Indexes by row, never by element."""
    if idx.dim() == 1:
        return t.index_select(2, idx)                                   # (B, H, T, D)
    B, H = t.shape[:2]
    b = torch.arange(B, device=t.device)[:, None, None]                 # (B, 1, 1)
    h = torch.arange(H, device=t.device)[None, :, None]                 # (1, H, 1)
    return t[b, h, idx.expand(B, H, -1)]                                # (B, H, T, D)


def row_perms(seed, lengths, T, heads=1):
    """SA's permutations for right-padded rows: (B, heads, T), row b permuting only its first
    lengths[b] tokens, its pads keeping their slots after them. Drawn from `seed` alone, so a
    row's permutation depends on the seed and its length, never on the rest of the batch."""
    rows = []
    for n in lengths.tolist():
        real = torch.rand(heads, n, generator=torch.Generator().manual_seed(seed)).argsort(-1)  # (heads, n)
        rows.append(torch.cat([real, torch.arange(n, T).expand(heads, -1)], -1))               # (heads, T)
    return torch.stack(rows)                                                                     # (B, heads, T)


def stochastic_attention(q, k, v, window, perm):
    """Stochastic attention: out (B, H, T, D) for q, k, v (B, H, T, D) and perm, a permutation of
    range(T) of shape (T,) or (B, H, T). The tokens are placed in slots by perm, SWA runs over the
    slots with pos=perm (so no token sees its future) and the output returns to token order:
    tokens a >= b interact iff their slots are fewer than `window` apart. Equals sa_reference."""
    B, H, T, D = q.shape
    _check_draw(perm, "perm", B, H, T)
    if _backend(q) == "torch":  # the layout does the gather by perm and the scatter back
        return _GroupedAttention.apply(q, k, v, _band_layout(B, H, T, check_positive(window), perm, perm))
    qs, ks, vs = (_take(t, perm) for t in (q, k, v))                    # (B, H, T, D) in slot order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)        # (B, H, T, D) in slot order
    return _take(ys, torch.argsort(perm, dim=-1))                      # (B, H, T, D) in token order


def sa_value_mask(delta, r):
    """SA's value rule in token order: val = r, width = delta, pos = arange(T)."""
    return rule_mask(r, torch.arange(r.shape[-1], device=r.device), delta)


def sa_value_reference(q, k, v, delta, r):
    return masked_attention(q, k, v, sa_value_mask(delta, r))


def stochastic_value_attention(q, k, v, delta, r):
    """Stochastic attention by the value rule: out (B, H, T, D) for q, k, v (B, H, T, D) and r, one
    uniform key in [0, 1) per token, shape (T,) or (B, H, T): tokens a >= b interact iff
    |r_a - r_b| < delta (delta = window / T matches the rank rule's pair probability). Sorted by r,
    the band runs over per-block key spans. Equals sa_value_reference."""
    B, H, T, D = q.shape
    _check_draw(r, "r", B, H, T)
    if not 0 < delta:
        raise ValueError(f"delta must be > 0, got {delta!r}")
    backend = _backend(q)
    if backend == "reference":
        return sa_value_reference(q, k, v, delta, r)
    perm = torch.argsort(r, dim=-1, stable=True)                       # (T,) or (B, H, T): ascending r
    if backend == "triton":  # gather into slot order, the kernel's band over r, scatter back
        qs, ks, vs = (_take(t, perm) for t in (q, k, v))                # (B, H, T, D) in slot order
        ys = _kernel(qs, ks, vs, delta, perm, r.gather(-1, perm).float())
        if ys is not None:
            return _take(ys, torch.argsort(perm, dim=-1))              # (B, H, T, D) in token order
    return _GroupedAttention.apply(q, k, v, _band_layout(B, H, T, delta, perm, perm, r.gather(-1, perm)))


# -----------------------------------------------------------------------------
# MoBA: each query's own block plus the past blocks its router picks.

def block_means(k, block_size):
    """(B, H, ceil(T / block_size), D) in fp32: the mean key of each block of k (B, H, T, D), the
    last block's over the keys it has. MoBA routes on these (moba_select, and GPT's KV cache)."""
    B, H, T, D = k.shape
    nblk = math.ceil(T / block_size)
    kpad = F.pad(k.float(), (0, 0, 0, nblk * block_size - T))           # (B, H, nblk*bs, D)
    counts = torch.full((nblk,), block_size, device=k.device)
    counts[-1] = T - (nblk - 1) * block_size
    return kpad.view(B, H, nblk, block_size, D).sum(3) / counts[:, None]  # (B, H, nblk, D)


@torch.no_grad()  # routing is a hard choice: no gradient flows through it, as in MoBA
def moba_select(q, k, block_size, top_k):
    """MoBA's routing, shared by both MoBA paths so they pick identical blocks; scored in fp32,
    as MoBA's own code does. Returns (B, H, T, top_k-1) indices of the chosen strictly-past
    blocks and a validity mask of the same shape (early queries have fewer past blocks)."""
    B, H, T, D = q.shape
    nblk = math.ceil(T / block_size)
    n = min(top_k - 1, nblk)
    kmean = block_means(k, block_size)                                  # (B, H, nblk, D)
    idx, ok = [], []
    step = max(1, CHUNK // (B * H * nblk))  # query rows per step: the scores are O(T^2 / block_size)
    for s in range(0, T, step):
        rows = torch.arange(s, min(s + step, T), device=q.device)
        scores = q[:, :, rows].float() @ kmean.transpose(-1, -2)        # (B, H, rows, nblk)
        past = torch.arange(nblk, device=q.device) < (rows // block_size)[:, None]  # (rows, nblk)
        top, i = scores.masked_fill(~past, float("-inf")).topk(n, dim=-1)  # (B, H, rows, n)
        idx.append(i)
        ok.append(top > float("-inf"))
    return torch.cat(idx, 2), torch.cat(ok, 2)


def moba_mask(q, k, block_size, top_k):
    """MoBA's rule: (B, H, T, T) bool, True where query i sees key j: j <= i, in i's own block
    or in one of the blocks moba_select picked for i."""
    T = q.shape[2]
    idx, ok = moba_select(q, k, block_size, top_k)
    nblk = math.ceil(T / block_size)
    chosen = torch.zeros(*idx.shape[:3], nblk, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)                                         # (B, H, T, nblk)
    blk = torch.arange(T, device=q.device) // block_size
    chosen[..., torch.arange(T), blk] = True                             # own block
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return chosen[..., blk] & causal                                     # (B, H, T, T)


def moba_reference(q, k, v, block_size, top_k):
    return masked_attention(q, k, v, moba_mask(q, k, block_size, top_k))


def _moba_layout(q, k, block_size, top_k):
    """Two kinds of groups, each a block of keys (L = block_size) and the queries that see it:
    - own: query block b and key block b, causal;
    - picked: the (query, block) pairs moba_select chose, sorted by key block and cut into
      tiles of C queries, so each tile is one small matmul against one key block.
    A query sits in 1 + (top_k - 1) groups; the engine merges them into one softmax."""
    B, H, T = q.shape[:3]
    BH, bs, device = B * H, block_size, q.device
    nblk = math.ceil(T / bs)
    C = BLOCK
    base = torch.arange(BH, device=device)[:, None] * T                      # (BH, 1): row offset of each head
    rows = F.pad(torch.arange(T, device=device) + base, (0, nblk * bs - T), value=BH * T)  # (BH, nblk*bs)
    own = rows.view(BH, nblk, bs)                                             # (BH, nblk, bs): queries = keys
    r = torch.arange(bs, device=device)
    own_mask = torch.zeros(bs, bs, device=device).masked_fill_(r[None, :] > r[:, None], NEG)  # (bs, bs)
    keymask = torch.zeros(nblk, bs, device=device)                            # (nblk, bs): pads of the last block
    keymask.view(-1)[T:] = NEG

    idx, ok = moba_select(q, k, bs, top_k)                                    # (B, H, T, n)
    pair_blk = (idx + torch.arange(BH, device=device).view(B, H, 1, 1) * nblk)[ok]  # (P,): head * nblk + block
    pair_row = (torch.arange(T, device=device) + base.view(B, H, 1)).unsqueeze(-1).expand_as(idx)[ok]  # (P,)
    pair_blk, order = pair_blk.sort(stable=True)
    pair_row = pair_row[order]
    count = torch.bincount(pair_blk, minlength=BH * nblk)                     # (BH*nblk,) queries per key block
    first = torch.cumsum(count, 0) - count                                    # where each block's pairs start
    ntile = (count + C - 1) // C
    tile0 = torch.cumsum(ntile, 0) - ntile                                    # each block's first tile
    rank = torch.arange(len(pair_blk), device=device) - first[pair_blk]       # rank of a pair in its block
    tile_q = torch.full((int(ntile.sum()), C), BH * T, device=device)         # (tiles, C): pad = the zero row
    tile_q.view(-1)[tile0[pair_blk] * C + rank] = pair_row
    tile_blk = torch.repeat_interleave(torch.arange(BH * nblk, device=device), ntile)  # (tiles,)
    tile_k = rows.view(BH * nblk, bs)[tile_blk]                               # (tiles, bs)
    tile_mask = keymask[tile_blk % nblk][:, None, :]                          # (tiles, 1, bs)
    n = max(1, CHUNK // (C * bs))                                             # tiles per chunk
    m = max(1, n // BH)                                                       # own blocks per chunk

    def chunks():
        for s in range(0, nblk, m):
            yield own[:, s:s + m], own[:, s:s + m], own_mask + keymask[s:s + m, None, :]  # (BH, m, bs), .., (m, bs, bs)
        for s in range(0, len(tile_q), n):
            yield tile_q[s:s + n], tile_k[s:s + n], tile_mask[s:s + n]          # (n, C), (n, bs), (n, 1, bs)
    chunks.merge = True  # a query is in 1 + (top_k - 1) groups
    chunks.order, chunks.take = None, _gather  # rows index q, k, v as they are
    return chunks


def moba_attention(q, k, v, block_size, top_k):
    """MoBA (Mixture of Block Attention): out (B, H, T, D) for q, k, v (B, H, T, D). Keys are split
    into blocks of block_size; query i sees its own block causally plus the top_k - 1 strictly-past
    blocks whose mean key scores highest against q_i (moba_select). Equals moba_reference."""
    check_positive(block_size, "block_size")
    check_positive(top_k, "top_k")
    if _backend(q) == "reference":
        return moba_reference(q, k, v, block_size, top_k)
    return _GroupedAttention.apply(q, k, v, _moba_layout(q, k, block_size, top_k))
