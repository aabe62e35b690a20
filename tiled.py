"""Support, which a first reading skips. The tiled torch engine: attention in O(T * w) time and memory, forward and backward, on any device.

attention.py runs its fast paths here (SWA with pos, so both SA rules, and MoBA, routed by moba_select) when it does
not run the Triton kernel; the rules themselves are stated in attention.py's docstring.

How it works. A layout (Band, Moba) cuts the (query, key) pairs a rule allows into GROUPS: nq query rows, the nk
key rows they may see, and an additive mask (nq, nk), 0 where the rule allows and -inf where it hides. Band is
SWA's band over slots: each tile of nq consecutive query slots sees one span of nk consecutive key slots around
it. Moba's groups are a query tile with its own key chunk, and tiles of the queries that picked one key chunk.
A CALL is a batch of groups sized to stay in cache: one batched call of four matmul-sized ops (on the CPU, of
PyTorch's fused flash-attention kernel for the band). Rows are rows of a flat fp32 copy of q, k, v (N, D); a
layout's calls yield index tensors of rows, and the band's are strided views of one arange, so that the same
strides applied to the flat copy (as_strided) read each call's keys without copying them. The backward is explicit
because autograd would keep every call's (nq, nk) probabilities until backward, O(T * nk) memory per layer; here
the forward keeps only the output and each row's logsumexp, and the backward recomputes each call's probabilities
from them. forward and backward are registered ops (band, moba, at the bottom), so that torch.compile sees one
node each.
"""
import math

import torch
import torch.nn.functional as F

TILE = 64            # query rows per group
CALL = 1 << 19       # score elements per call of matmuls: a call's scores stay in cache
FUSED_CALL = 1 << 23  # per call of the fused forward, which tiles its scores itself: fewer, larger calls
                     # (its backward keeps CALL: measured faster)
NEG = float("-inf")  # hidden scores; every real query sees itself, so no real row is all -inf


def band_edges(window, T, two_sided):
    """The slot band [i - left, i + right] of a window, one-sided (right = 0) for plain causal SWA; |i - j| < T
    always holds, so a window past T is T. kernel.band_edges is a copy (tests/test_kernel.py holds them equal)."""
    left = min(int(window), T) - 1
    return left, left if two_sided else 0


def value_spans(r, width, margin, tile):
    """The value rule's key spans: [lo, hi) of the slots each tile of `tile` query slots may meet, (R, ntiles)
    each, for r (R, T) ascending along T; `margin` past width, for fp32 rounding. kernel.value_spans is a copy."""
    first = torch.arange(0, r.shape[-1], tile, device=r.device)                       # (ntiles,)
    last = (first + tile).clamp(max=r.shape[-1]) - 1
    hi = torch.searchsorted(r, r[:, last] + width + margin).maximum(last + 1)        # (R, ntiles): its own slots in
    return torch.searchsorted(r, r[:, first] - width - margin), hi


class Band:
    """The band over slots: key slot j is visible to query slot i iff |i - j| < width (with r:
    |r[i] - r[j]| < width) and pos[j] <= pos[i]; pos (T,) or broadcastable to (B, H, T),
    None for plain causal SWA; r has pos's shape, ascending along T. Rows index a flat fp32 copy of q, k, v
    (`flat`) that pads each head with `left` zero slots before its T slots and `right` after, so that every
    tile of nq query slots sees the same nk = left + nq + right key slots around it, and the key spans are
    strided VIEWS of the copy:

        slots:    | pad |  0 ...                                      T-1 | pad |
        tile 0   [left |  nq  | right]
        tile 1         [left |  nq  | right]      (one-sided SWA: right = 0)
        tile 2               [left |  nq  | right]

    With r (the value rule: slots sorted by r), tile b's span starts at the first slot within width of
    the tile's smallest r and has the length the widest tile needs: a gather, not a view."""
    # merge: whether a query row is in several groups whose outputs forward merges (not here: exactly one group);
    # wide: whether the groups are wide enough for the fused CPU kernel (here nk >= nq + width - 1 keys)
    merge, wide = False, True

    def __init__(self, q, width, pos=None, r=None, margin=0.0):
        (B, H, T, _), device = q.shape, q.device
        BH = B * H
        nq = min(TILE, 1 << (T - 1).bit_length())            # small T needs no full tile
        nb = math.ceil(T / nq)
        if r is None:
            left, right = band_edges(width, T, pos is not None)
            nk = left + nq + right
            d = torch.arange(nk, device=device) - torch.arange(nq, device=device)[:, None] - left  # (nq, nk): k - q
            self.band = torch.zeros(nq, nk, device=device).masked_fill_((d < -left) | (d > right), NEG)
        else:
            r = r.expand(B, H, T).reshape(BH, T) if r.dim() == 3 else r[None]  # (R, T), R = 1 or BH
            start, end = value_spans(r, width, margin, nq)                      # (R, nb): each tile's key span
            first = torch.arange(nb, device=device) * nq                         # (nb,): each tile's first slot
            # every tile's span must hold its keys and its own slots (pads too): the longest such span, for all
            nk = int((torch.maximum(end, first + nq) - start).max())
            left, right = 0, nk - nq
            self.kslots = start[..., None] + torch.arange(nk, device=device)     # (R, nb, nk)
            r = F.pad(r, (0, nb * nq - T + right))                              # (R, S): pads hidden by pos
        if pos is None:
            pos = torch.arange(T, device=device)
        pos = pos.expand(B, H, T).reshape(BH, T) if pos.dim() == 3 else pos[None]   # (R, T)
        self.S = left + nb * nq + right
        self.pos = pos.new_full((len(pos), self.S), torch.iinfo(torch.long).max)     # (R, S): pads in the future
        self.pos[:, left:left + T] = pos
        self.rows = torch.arange(BH * self.S, device=device).view(BH, self.S)  # (BH, S): rows of the flat copy
        self.shape, self.width, self.r, self.nq, self.nk, self.left, self.nb = (B, H, T), width, r, nq, nk, left, nb

    def flat(self, t):
        """(B, H, T, D) -> (BH * S, D) fp32, each head between its zero pads: one copy."""
        (B, H, T), D = self.shape, t.shape[-1]
        f = t.new_empty(B * H, self.S, D, dtype=torch.float32)
        f[:, :self.left], f[:, self.left + T:] = 0, 0
        f.view(B, H, self.S, D)[:, :, self.left:self.left + T] = t.detach()  # any strides, any dtype: one pass
        return f.view(-1, D)

    def unflat(self, f):
        """flat undone, as a view of f: (BH * S, D) -> (B, H, T, D)."""
        T = self.shape[2]
        return f.view(-1, self.S, f.shape[-1])[:, self.left:self.left + T].view(*self.shape, -1)

    def view(self, f, rows):
        """f (N, D) at rows, where rows is a strided view of self.rows = arange(N) (a tile's query slots, the slot
        band's key spans): since self.rows[i] is i, the same strides (times D) over f give f[rows] as a view,
        without a copy, and writable (forward writes each call's output through its query rows)."""
        return f.as_strided((*rows.shape, f.shape[-1]), (*(st * f.shape[-1] for st in rows.stride()), f.stride(-1)),
                            rows.storage_offset() * f.shape[-1])

    query = view  # a tile's query rows are consecutive slots: always a view

    def keys(self, f, rows):
        """f (N, D) at key rows: the spans of the slot band are views of f, the value rule's a gather."""
        if self.r is not None:
            return f.index_select(0, rows.flatten()).view(*rows.shape, f.shape[-1])
        return self.view(f, rows)

    def spans(self, t, heads, s, e):
        """t (R or BH, S) at the key slots of tiles s..e-1 of the heads `heads` (a slice of m): (m or 1, e-s, nk)."""
        nq, nk, t = self.nq, self.nk, t[heads]
        if self.r is None:
            return t[:, s * nq:(e - 1) * nq + nk].unfold(1, nk, nq)                  # a strided view
        ks = self.kslots[heads] if len(self.kslots) > 1 else self.kslots
        return t.gather(1, ks[:, s:e].flatten(1).expand(len(t), -1)).view(len(t), e - s, nk)

    def mask(self, heads, s, e):
        """The rule's additive mask in tiles s..e-1 of the heads `heads`: (m or 1, e-s, nq, nk)."""
        nq, q = self.nq, slice(self.left + s * self.nq, self.left + e * self.nq)
        qpos = self.pos[heads, q].unflatten(1, (e - s, nq))                       # (m or 1, e-s, nq)
        visible = self.spans(self.pos, heads, s, e)[..., None, :] <= qpos[..., :, None]
        if self.r is None:
            return torch.where(visible, self.band, NEG)
        qr = self.r[heads, q].unflatten(1, (e - s, nq))                           # (m or 1, e-s, nq)
        visible &= (qr[..., :, None] - self.spans(self.r, heads, s, e)[..., None, :]).abs() < self.width
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, NEG)

    def calls(self, size):
        """(query rows (m, n, nq), key rows (m, n, nk), mask (m or 1, n, nq, nk)) per call of about size scores."""
        nq, nk, nb = self.nq, self.nk, self.nb
        n = min(nb, max(1, size // (nq * nk)))                   # tiles per call
        m = max(1, size // (nq * nk * nb))                       # heads per call, when one head's tiles all fit
        shared = len(self.pos) == 1                            # a pos shared by the heads: one mask for all
        for s in range(0, nb, n):
            e = min(s + n, nb)
            mask = self.mask(slice(0, 1), s, e) if shared else None
            for h in range(0, len(self.rows), m):
                heads = slice(h, h + m)
                qrows = self.rows[heads, self.left + s * nq:self.left + e * nq].unflatten(1, (e - s, nq))
                yield qrows, self.spans(self.rows, heads, s, e), mask if shared else self.mask(heads, s, e)


def chunk_means(k, moba_chunk):
    """(B, H, ceil(T / moba_chunk), D) fp32: each chunk's mean key (the last's over its keys), MoBA's routing keys."""
    B, H, T, D = k.shape
    nc = math.ceil(T / moba_chunk)
    kpad = F.pad(k.float(), (0, 0, 0, nc * moba_chunk - T)).view(B, H, nc, moba_chunk, D)
    counts = (T - torch.arange(nc, device=k.device) * moba_chunk).clamp(max=moba_chunk)  # (nc,): keys
    return kpad.sum(3) / counts[:, None]                                # (B, H, nc, D)


@torch.no_grad()  # routing is a hard choice: no gradient flows through it, as in MoBA
def moba_select(q, k, moba_chunk, top_k):
    """MoBA's routing, in fp32 as MoBA's own code, for attention.py's two MoBA paths: (B, H, T, top_k-1) indices
    of the chosen strictly-past chunks, and which are valid (early queries have fewer past chunks)."""
    B, H, T, D = q.shape
    nc = math.ceil(T / moba_chunk)
    kmean = chunk_means(k, moba_chunk)                                  # (B, H, nc, D)
    n = min(top_k - 1, nc)
    idx, ok = [q.new_zeros(B, H, 0, n, dtype=torch.long)], [q.new_zeros(B, H, 0, n, dtype=torch.bool)]  # T = 0: empty
    step = max(1, CALL // max(1, B * H * nc))  # query rows per step: the scores are O(T^2 / moba_chunk)
    for s in range(0, T, step):
        rows = torch.arange(s, min(s + step, T), device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            scores = q[:, :, rows].float() @ kmean.transpose(-1, -2)    # (B, H, rows, nc)
        past = torch.arange(nc, device=q.device) < (rows // moba_chunk)[:, None]  # (rows, nc)
        top, i = scores.masked_fill(~past, float("-inf")).topk(n, dim=-1)  # (B, H, rows, n)
        idx.append(i)
        ok.append(top > float("-inf"))
    return torch.cat(idx, 2), torch.cat(ok, 2)


class Moba:
    """MoBA's groups, each a chunk of moba_chunk keys and the queries that see it:
    - own: the queries of chunk c with its keys, causal;
    - picked: the (query, chunk) pairs the router chose (idx, ok: moba_select's), sorted
      by key chunk and cut into tiles of nq queries, so that each tile is one small matmul.
    Rows index q, k, v flattened to (B*H*T + 1, D), the extra last row zeros (what pads read)."""
    merge, wide = True, False  # (see Band) a query is in 1 + (top_k - 1) groups; groups of moba_chunk keys

    def __init__(self, q, moba_chunk, idx, ok):
        (B, H, T, _), device = q.shape, q.device
        BH, c, nq = B * H, moba_chunk, TILE
        self.shape = (B, H, T)
        nc = math.ceil(T / c)
        base = torch.arange(BH, device=device)[:, None] * T                        # (BH, 1): each head's first row
        rows = F.pad(torch.arange(T, device=device) + base, (0, nc * c - T), value=BH * T)  # (BH, nc*c)
        self.own = rows.view(BH, nc, c)                                             # queries = keys
        i, S = torch.arange(c, device=device), nc * c
        keypad = torch.zeros(S, device=device).index_fill_(0, torch.arange(T, S, device=device), NEG).view(nc, c)
        causal = torch.zeros(c, c, device=device).masked_fill_(i[None, :] > i[:, None], NEG)  # (c, c)
        self.own_mask = causal + keypad[:, None]                                    # (nc, c, c)
        pair_chunk = (idx + torch.arange(BH, device=device).view(B, H, 1, 1) * nc)[ok]  # (P,): head*nc + chunk
        pair_row = (torch.arange(T, device=device) + base.view(B, H, 1)).unsqueeze(-1).expand_as(idx)[ok]  # (P,)
        pair_chunk, order = pair_chunk.sort(stable=True)
        pair_row = pair_row[order]
        count = torch.bincount(pair_chunk, minlength=BH * nc)                       # (BH*nc,): queries per chunk
        first = torch.cumsum(count, 0) - count                                      # where each chunk's pairs start
        ntile = (count + nq - 1) // nq
        tile0 = torch.cumsum(ntile, 0) - ntile                                      # each chunk's first tile
        rank = torch.arange(len(pair_chunk), device=device) - first[pair_chunk]     # a pair's rank in its chunk
        self.tile_q = torch.full((int(ntile.sum()), nq), BH * T, device=device)  # (tiles, nq): pads read the zero row
        self.tile_q.view(-1)[tile0[pair_chunk] * nq + rank] = pair_row
        tile_chunk = torch.repeat_interleave(torch.arange(BH * nc, device=device), ntile)  # (tiles,)
        self.tile_k = rows.view(BH * nc, c)[tile_chunk]                             # (tiles, c)
        self.tile_mask = keypad[tile_chunk % nc][:, None, :]                        # (tiles, 1, c)

    def flat(self, t):
        return F.pad(t.detach().float().flatten(0, 2), (0, 0, 0, 1))                # (B*H*T + 1, D)

    def unflat(self, f):
        return f[:-1].view(*self.shape, -1)                                         # (B, H, T, D)

    def keys(self, f, rows):
        return f.index_select(0, rows.flatten()).view(*rows.shape, f.shape[-1])   # faster than f[rows]

    query = keys  # a query's rows are scattered over tiles; forward never writes through them (merge)

    def calls(self, size):
        c = self.own.shape[-1]
        n = max(1, size // (TILE * c))                       # tiles per call
        m = max(1, n // len(self.own))                       # own chunks per call
        for s in range(0, self.own.shape[1], m):     # (BH, m, c), (BH, m, c), (1, m, c, c)
            yield self.own[:, s:s + m], self.own[:, s:s + m], self.own_mask[None, s:s + m]
        for s in range(0, len(self.tile_q), n):      # (n, 1, nq), (n, 1, c), (n, 1, 1, c)
            yield self.tile_q[s:s + n, None], self.tile_k[s:s + n, None], self.tile_mask[s:s + n, None]


def _masked(s, mask, finite):
    """Scores s with the additive mask applied: added where every key is finite (fast), else filled."""
    return s.add_(mask) if finite else s.masked_fill_(mask == NEG, NEG)


def _finite(k):
    """Whether every key is finite, read off one sum (a pass, where isfinite().all() takes three): a sum
    that overflows only sends finite keys down the exact, slower fill path."""
    return bool(k.sum().isfinite())


def _fused(q, finite, layout):
    """Whether PyTorch's fused CPU flash-attention kernel runs the groups (it takes an additive mask, and
    returns the logsumexp the backward needs): on the CPU, where every key is finite (NaN + -inf is NaN),
    for the band's wide groups (MoBA's 64-key tiles run faster as plain matmuls)."""
    return (q.device.type == "cpu" and finite and layout.wide  # wide: the band's groups, not MoBA's tiles
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _group_forward(qc, kc, vc, mask, finite, fused):
    """softmax(qc kc^T / sqrt(D) + mask) vc and its logsumexp, per group: (m, n, nq, D), (m, n, nq)."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qc, kc, vc, attn_mask=mask)
    s = _masked((qc @ kc.transpose(-1, -2)).mul_(qc.shape[-1] ** -0.5), mask, finite)  # (m, n, nq, nk)
    top = s.amax(-1, keepdim=True)                                          # (m, n, nq, 1): every row sees a key
    p = s.sub_(top).exp_()                                                  # unnormalised: one exp pass
    total = p.sum(-1, keepdim=True)
    return (p @ vc).div_(total), (top + total.log()).squeeze(-1)


def _group_backward(doc, qc, kc, vc, lse, rowdot, mask, finite):
    """dq, dk, dv of each group, its probabilities recomputed from lse (the row's over all its groups);
    rowdot is each row's rowsum(dO * O). In place: two (nq, nk) buffers stay in cache, not three."""
    scale = qc.shape[-1] ** -0.5
    p = _masked((qc @ kc.transpose(-1, -2)).mul_(scale), mask, finite).sub_(lse[..., None]).exp_()  # (m, n, nq, nk)
    dv = p.transpose(-1, -2) @ doc
    ds = p.mul_((doc @ vc.transpose(-1, -2)).sub_(rowdot[..., None]))       # (m, n, nq, nk): dloss/dscores
    return (ds @ kc).mul_(scale), (ds.transpose(-1, -2) @ qc).mul_(scale), dv


def forward(q, k, v, layout):
    """softmax over each query's groups in `layout`: out (B, H, T, D) in q's dtype and each row's logsumexp
    (B, H, T) in fp32. A key that is not finite gets its hidden scores set to -inf, not -inf added
    (NaN + -inf is NaN), so that its NaN never reaches a query that may not see it."""
    qf, kf, vf = layout.flat(q), layout.flat(k), layout.flat(v)             # (N, D)
    # With merge (MoBA), a query's groups are merged online: the largest logsumexp so far (top),
    # the sum of exp(lse - top) (total) and the output sum. Without, each row is written once.
    top = torch.full_like(qf[:, 0], NEG)                                    # (N,)
    total, out = torch.zeros_like(top), torch.zeros_like(qf) if layout.merge else torch.empty_like(qf)
    finite = _finite(kf)
    fused = _fused(qf, finite, layout)
    for qrows, krows, mask in layout.calls(FUSED_CALL if fused else CALL):  # (m, n, nq), (m, n, nk), (.., nq, nk)
        o, lse = _group_forward(layout.query(qf, qrows), layout.keys(kf, krows), layout.keys(vf, krows), mask,
                                finite, fused)
        if not layout.merge:  # each query row in one group (the band): its output written once, through the view
            layout.query(out, qrows).copy_(o)
            layout.query(top[:, None], qrows)[..., 0].copy_(lse)
            continue
        rows, o, lse = qrows.flatten(), o.flatten(0, -2), lse.flatten()     # this call's query rows, (n, D), (n,)
        seen = rows.unique()                                                # a row may be in several groups
        old = top[seen]
        top.scatter_reduce_(0, rows, lse, "amax")
        rescale = (old - top[seen]).exp_()                                  # earlier groups, to the new max
        total[seen] *= rescale
        out[seen] *= rescale[:, None]
        w = (lse - top[rows]).exp_()                                        # (n,)
        total.index_add_(0, rows, w)
        out.index_add_(0, rows, o.mul_(w[:, None]))
    if layout.merge:  # MoBA: normalise the merged sums
        out /= total[:, None]
        top += total.log()                                                  # the logsumexp of each row
    return _unflat(layout, out, q.dtype), _unflat(layout, top[:, None], torch.float32)[..., 0]


@torch.autocast("cpu", enabled=False)  # scores in fp32, even where backward runs under autocast
@torch.autocast("cuda", enabled=False)
def backward(dout, out, lse, q, k, v, layout):
    """dq, dk, dv (B, H, T, D) of forward's out: each group's share, from its rows' out and logsumexp."""
    qf, kf, vf, dof = (layout.flat(t) for t in (q, k, v, dout))            # (N, D)
    lse = layout.flat(lse[..., None])[:, 0]                                 # (N,); pad rows 0, their dO is 0
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    finite = _finite(kf)
    fused = _fused(qf, finite, layout)
    if fused:                                                               # the kernel takes O's rows
        of = layout.flat(out)
    else:                                                                   # the matmuls, rowsum(dO * O)
        rowdot = layout.flat((dout.float() * out.float()).sum(-1, keepdim=True))[:, 0]  # (N,)
    for qrows, krows, mask in layout.calls(CALL):
        qc, doc = layout.query(qf, qrows), layout.query(dof, qrows)
        kc, vc = layout.keys(kf, krows), layout.keys(vf, krows)
        if fused:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                doc, qc, kc, vc, layout.query(of, qrows), lse[qrows], 0.0, False, attn_mask=mask)
        else:
            grads = _group_backward(doc, qc, kc, vc, lse[qrows], rowdot[qrows], mask, finite)
        for g, rows, grad in ((dq, qrows, grads[0]), (dk, krows, grads[1]), (dv, krows, grads[2])):
            g.index_add_(0, rows.flatten(), grad.flatten(0, -2))
    return _unflat(layout, dq, q.dtype), _unflat(layout, dk, k.dtype), _unflat(layout, dv, v.dtype)


def _unflat(layout, f, dtype):
    """(N, D) fp32 -> (B, H, T, D) of dtype, contiguous (what the ops' fake shapes promise)."""
    return layout.unflat(f).to(dtype).contiguous()


def _save(ctx, inputs, output):
    ctx.save_for_backward(*output, *inputs[:5])            # out, lse, q, k, v and the op's two tensors
    ctx.scalars = inputs[5:]


def _op(name, layout, args):
    """The registered op sa::name(q, k, v, args) -> (out, lse), forward over layout(q, *args), with its backward op,
    fake shapes and autograd, as kernel.py registers sa::triton_swa."""
    qkv = f"Tensor q, Tensor k, Tensor v, {args}"
    fwd = torch.library.custom_op(f"sa::{name}", lambda q, k, v, *a: forward(q, k, v, layout(q, *a)),
                                  mutates_args=(), schema=f"({qkv}) -> (Tensor, Tensor)")
    bwd = torch.library.custom_op(f"sa::{name}_backward",
                                  lambda dout, out, lse, q, k, v, *a: backward(dout, out, lse, q, k, v, layout(q, *a)),
                                  mutates_args=(), schema=f"(Tensor dout, Tensor out, Tensor lse, {qkv}) -> "
                                                          "(Tensor, Tensor, Tensor)")
    fwd.register_fake(lambda q, *_: (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)))
    bwd.register_fake(lambda dout, out, lse, *qkv: tuple(t.new_empty(t.shape) for t in qkv[:3]))
    fwd.register_autograd(lambda ctx, dout, _: (*bwd(dout, *ctx.saved_tensors, *ctx.scalars),
                                                *[None] * (2 + len(ctx.scalars))), setup_context=_save)
    return fwd


# The engine's entry points: out (B, H, T, D) = band(q, k, v, ...)[0]. Registered ops, so that torch.compile
# sees one opaque node each (no graph break), not the call loops and the band's strided views.
band = _op("band", lambda q, pos, r, width, margin: Band(q, width, pos, r, margin),
           "Tensor? pos, Tensor? r, float width, float margin")
moba = _op("moba", lambda q, idx, ok, moba_chunk: Moba(q, moba_chunk, idx, ok), "Tensor idx, Tensor ok, int moba_chunk")


def band_attention(q, k, v, pos, r, width, margin):
    """The band's output (B, H, T, D), as attention.py runs its engines: (q, k, v, pos, r, width, margin)."""
    return band(q, k, v, pos, r, width, margin)[0]
