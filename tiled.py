"""Support, which a first reading skips. Tiled attention in O(T * w) time and memory, forward and backward, on any
device: SWA's and SA's band for attention.py's torch engine (Band), and MoBA always (Moba).

A layout cuts the pairs a rule allows into groups (nq query rows, the nk key rows they see, a mask), batched in calls
whose scores fit in cache. The backward recomputes probabilities from each row's logsumexp (autograd would keep them:
O(T * nk)).
"""
import math

import torch
import torch.nn.functional as F

TILE = 64  # query rows per tile
CALL = 1 << 19  # scores per call
FUSED_CALL = 1 << 23  # scores per fused forward call (it tiles them)
NEG = float("-inf")  # hidden; no real row is all -inf (a real query sees itself)


def band_edges(window, T, two_sided):
    """The slot band [i - left, i + right]; a window past T is T. Copied in kernel.py."""
    left = min(int(window), T) - 1
    return left, left if two_sided else 0


def value_spans(r, width, margin, tile):
    """The value rule's key slots [lo, hi) (R, ntiles) per tile, r (R, T) ascending; margin for fp32 rounding. Copied
    in kernel.py."""
    first = torch.arange(0, r.shape[-1], tile, device=r.device)  # (ntiles,)
    last = (first + tile).clamp(max=r.shape[-1]) - 1
    hi = torch.searchsorted(r, r[:, last] + width + margin).maximum(last + 1)  # (R, ntiles), own slots in
    return torch.searchsorted(r, r[:, first] - width - margin), hi


class Band:
    """attention.py's rule in slot order: slot[i] = i, or r[i] given r; pos (T,) or 3-dim, broadcastable to (B, H, T)
    (None: causal SWA), r of pos's shape, ascending. flat pads each head with `left` zero slots before and `right` (and
    the last tile's rest) after: a tile of nq query slots sees the nk slots around it:

        | pad |  0 ...         T-1 | pad |
        [left |  nq  | right]
              [left |  nq  | right]  (causal SWA: right = 0)

    With r, a tile's nk key slots start at its value_spans lo: a gather."""
    merge, wide = False, True  # merge: a row in several groups; wide: see _fused

    def __init__(self, q, pos, r, width, margin):
        (B, H, T, _), device = q.shape, q.device
        BH = B * H
        nq = min(TILE, 1 << (T - 1).bit_length())  # small T needs no full tile
        nb = math.ceil(T / nq)
        if r is None:
            left, right = band_edges(width, T, pos is not None)
            nk = left + nq + right
            d = torch.arange(nk, device=device) - torch.arange(nq, device=device)[:, None] - left  # (nq, nk): k - q
            self.band = torch.zeros(nq, nk, device=device).masked_fill_((d < -left) | (d > right), NEG)
        else:
            r = r.expand(B, H, T).reshape(BH, T) if r.dim() == 3 else r[None]  # (R, T), R = 1 or BH
            start, end = value_spans(r, width, margin, nq)  # (R, nb)
            first = torch.arange(nb, device=device) * nq  # (nb,)
            nk = int((torch.maximum(end, first + nq) - start).max())  # longest, own slots in
            left, right = 0, nk - nq
            self.kslots = start[..., None] + torch.arange(nk, device=device)  # (R, nb, nk)
            r = F.pad(r, (0, nb * nq - T + right))  # (R, S): pads hidden by pos
        pos = torch.arange(T, device=device) if pos is None else pos
        pos = pos.expand(B, H, T).reshape(BH, T) if pos.dim() == 3 else pos[None]  # (R, T)
        self.S = left + nb * nq + right
        self.pos = pos.new_full((len(pos), self.S), torch.iinfo(torch.long).max)  # (R, S): pads in the future
        self.pos[:, left:left + T] = pos
        self.rows = torch.arange(BH * self.S, device=device).view(BH, self.S)  # (BH, S)
        self.shape, self.width, self.r, self.nq, self.nk, self.left, self.nb = (B, H, T), width, r, nq, nk, left, nb

    def flat(self, t):
        """(B, H, T, D) -> (BH * S, D) fp32 between zero pads, one copy."""
        (B, H, T), D = self.shape, t.shape[-1]
        f = t.new_empty(B * H, self.S, D, dtype=torch.float32)
        f[:, :self.left], f[:, self.left + T:] = 0, 0
        f.view(B, H, self.S, D)[:, :, self.left:self.left + T] = t.detach()
        return f.view(-1, D)

    def unflat(self, f, dtype):
        """flat undone: (B, H, T, D) of dtype, contiguous (as the fake shapes promise)."""
        T = self.shape[2]
        return f.view(-1, self.S, f.shape[-1])[:, self.left:self.left + T].view(*self.shape, -1).to(dtype).contiguous()

    def query(self, f, rows):
        """f[rows], a writable view of f (N, D): rows is a view of self.rows = arange(N)."""
        D = f.shape[-1]
        return f.as_strided((*rows.shape, D), (*(st * D for st in rows.stride()), f.stride(-1)),
                            rows.storage_offset() * D)

    def keys(self, f, rows):
        return self.query(f, rows) if self.r is None else _gather(f, rows)

    def spans(self, t, heads, s, e):
        """t (R or BH, S) at the key slots of tiles s..e-1 of `heads` (a slice of m): (m or 1, e-s, nk)."""
        nq, nk, t = self.nq, self.nk, t[heads]
        if self.r is None:
            return t[:, s * nq:(e - 1) * nq + nk].unfold(1, nk, nq)  # a strided view
        ks = self.kslots[heads] if len(self.kslots) > 1 else self.kslots
        return t.gather(1, ks[:, s:e].flatten(1).expand(len(t), -1)).view(len(t), e - s, nk)

    def mask(self, heads, s, e):
        """The mask of tiles s..e-1 of `heads`: (m or 1, e-s, nq, nk)."""
        nq = self.nq
        q = slice(self.left + s * nq, self.left + e * nq)
        qpos = self.pos[heads, q].unflatten(1, (e - s, nq))  # (m or 1, e-s, nq)
        visible = self.spans(self.pos, heads, s, e)[..., None, :] <= qpos[..., :, None]
        if self.r is None:
            return torch.where(visible, self.band, NEG)
        qr = self.r[heads, q].unflatten(1, (e - s, nq))  # (m or 1, e-s, nq)
        visible &= (qr[..., :, None] - self.spans(self.r, heads, s, e)[..., None, :]).abs() < self.width
        return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, NEG)

    def calls(self, size):
        """(query rows (m, n, nq), key rows (m, n, nk), mask (m or 1, n, nq, nk)) per call of ~size scores."""
        nq, nk, nb = self.nq, self.nk, self.nb
        n = min(nb, max(1, size // (nq * nk)))  # tiles per call
        m = max(1, size // (nq * nk * nb))  # heads per call
        for s in range(0, nb, n):
            e = min(s + n, nb)
            common = self.mask(slice(0, 1), s, e) if len(self.pos) == 1 else None  # one mask for all heads
            for h in range(0, len(self.rows), m):
                heads = slice(h, h + m)
                qrows = self.rows[heads, self.left + s * nq:self.left + e * nq].unflatten(1, (e - s, nq))
                yield qrows, self.spans(self.rows, heads, s, e), self.mask(heads, s, e) if common is None else common


def _gather(f, rows):
    return f.index_select(0, rows.flatten()).view(*rows.shape, f.shape[-1])  # f[rows], faster


def chunk_means(k, moba_chunk):
    """MoBA's routing keys, each chunk's mean key, fp32."""
    B, H, T, D = k.shape
    nc = math.ceil(T / moba_chunk)
    kpad = F.pad(k.float(), (0, 0, 0, nc * moba_chunk - T)).view(B, H, nc, moba_chunk, D)
    counts = (T - torch.arange(nc, device=k.device) * moba_chunk).clamp(max=moba_chunk)  # (nc,)
    return kpad.sum(3) / counts[:, None]  # (B, H, nc, D)


@torch.no_grad()
def moba_select(q, k, moba_chunk, top_k):
    """MoBA's routing (fp32, no gradient, as in MoBA): (B, H, T, min(top_k - 1, chunks)) indices of the strictly-past
    chunks picked, and which are valid (early queries have fewer)."""
    B, H, T, D = q.shape
    nc = math.ceil(T / moba_chunk)
    kmean = chunk_means(k, moba_chunk)  # (B, H, nc, D)
    n, idx, ok = min(top_k - 1, nc), [], []
    step = max(1, CALL // max(1, B * H * nc))  # query rows per step
    for s in range(0, T, step):
        rows = torch.arange(s, min(s + step, T), device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            scores = q[:, :, rows].float() @ kmean.transpose(-1, -2)  # (B, H, rows, nc)
        past = torch.arange(nc, device=q.device) < (rows // moba_chunk)[:, None]  # (rows, nc)
        top, i = scores.masked_fill(~past, NEG).topk(n, dim=-1)  # (B, H, rows, n)
        idx.append(i)
        ok.append(top > NEG)
    if not T:
        return q.new_zeros(B, H, 0, n, dtype=torch.long), q.new_zeros(B, H, 0, n, dtype=torch.bool)
    return torch.cat(idx, 2), torch.cat(ok, 2)


class Moba:
    """MoBA's groups of a chunk's keys: own (its queries, causal), picked (idx, ok's pairs by chunk, in tiles of nq
    queries). Rows index q, k, v as (B*H*T + 1, D), the last zeros."""
    merge, wide = True, False  # a query in up to top_k groups

    def __init__(self, q, idx, ok, moba_chunk):
        (B, H, T, _), device = q.shape, q.device
        BH, c, nq = B * H, moba_chunk, TILE
        self.shape, nc = (B, H, T), math.ceil(T / c)
        base = torch.arange(BH, device=device)[:, None] * T  # (BH, 1)
        rows = F.pad(torch.arange(T, device=device) + base, (0, nc * c - T), value=BH * T)  # (BH, nc*c)
        self.own = rows.view(BH, nc, c)  # queries = keys
        i, S = torch.arange(c, device=device), nc * c
        keypad = torch.zeros(S, device=device).index_fill_(0, torch.arange(T, S, device=device), NEG).view(nc, c)
        causal = torch.zeros(c, c, device=device).masked_fill_(i[None, :] > i[:, None], NEG)  # (c, c)
        self.own_mask = causal + keypad[:, None]  # (nc, c, c)
        pair_chunk = (idx + torch.arange(BH, device=device).view(B, H, 1, 1) * nc)[ok]  # (P,): head*nc + chunk
        pair_row = (torch.arange(T, device=device) + base.view(B, H, 1)).unsqueeze(-1).expand_as(idx)[ok]  # (P,)
        pair_chunk, order = pair_chunk.sort(stable=True)
        pair_row = pair_row[order]
        count = torch.bincount(pair_chunk, minlength=BH * nc)  # (BH*nc,): queries per chunk
        first = torch.cumsum(count, 0) - count
        ntile = (count + nq - 1) // nq
        tile0 = torch.cumsum(ntile, 0) - ntile
        rank = torch.arange(len(pair_chunk), device=device) - first[pair_chunk]  # in its chunk
        self.tile_q = torch.full((int(ntile.sum()), nq), BH * T, device=device)  # (tiles, nq); pads: row BH*T
        self.tile_q.view(-1)[tile0[pair_chunk] * nq + rank] = pair_row
        tile_chunk = torch.repeat_interleave(torch.arange(BH * nc, device=device), ntile)  # (tiles,)
        self.tile_k = rows.view(BH * nc, c)[tile_chunk]  # (tiles, c)
        self.tile_mask = keypad[tile_chunk % nc][:, None, :]  # (tiles, 1, c)

    def flat(self, t):
        return F.pad(t.detach().float().flatten(0, 2), (0, 0, 0, 1))  # (B*H*T + 1, D)

    def unflat(self, f, dtype):
        return f[:-1].view(*self.shape, -1).to(dtype).contiguous()  # (B, H, T, D)

    keys = query = staticmethod(_gather)  # merge: forward writes no query rows

    def calls(self, size):
        c = self.own.shape[-1]
        n = max(1, size // (TILE * c))  # tiles per call
        m = max(1, n // len(self.own))  # own chunks per call
        for s in range(0, self.own.shape[1], m):  # (BH, m, c), (BH, m, c), (1, m, c, c)
            yield self.own[:, s:s + m], self.own[:, s:s + m], self.own_mask[None, s:s + m]
        for s in range(0, len(self.tile_q), n):  # (n, 1, nq), (n, 1, c), (n, 1, 1, c)
            yield self.tile_q[s:s + n, None], self.tile_k[s:s + n, None], self.tile_mask[s:s + n, None]


def _masked(s, mask, finite):
    """s plus the mask where keys are finite (fast), else filled."""
    return s.add_(mask) if finite else s.masked_fill_(mask == NEG, NEG)


def _fused(q, finite, layout):
    """Whether the fused CPU flash attention runs the groups: finite keys (NaN + -inf is NaN), wide groups (MoBA's
    are faster as matmuls)."""
    return (q.device.type == "cpu" and finite and layout.wide
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _group_forward(qc, kc, vc, mask, finite, fused):
    """softmax(qc kc^T / sqrt(D) + mask) vc, logsumexp: (m, n, nq, D), (m, n, nq)."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qc, kc, vc, attn_mask=mask)
    s = _masked((qc @ kc.transpose(-1, -2)).mul_(qc.shape[-1] ** -0.5), mask, finite)  # (m, n, nq, nk)
    top = s.amax(-1, keepdim=True)  # (m, n, nq, 1): every row sees a key
    p = s.sub_(top).exp_()  # unnormalised
    total = p.sum(-1, keepdim=True)
    return (p @ vc).div_(total), (top + total.log()).squeeze(-1)


def _group_backward(doc, qc, kc, vc, lse, rowdot, mask, finite):
    """dq, dk, dv per group, from lse (over the row's groups) and rowdot = rowsum(dO * O), in place."""
    scale = qc.shape[-1] ** -0.5
    p = _masked((qc @ kc.transpose(-1, -2)).mul_(scale), mask, finite).sub_(lse[..., None]).exp_()  # (m, n, nq, nk)
    dv = p.transpose(-1, -2) @ doc
    ds = p.mul_((doc @ vc.transpose(-1, -2)).sub_(rowdot[..., None]))  # (m, n, nq, nk): dloss/dscores
    return (ds @ kc).mul_(scale), (ds.transpose(-1, -2) @ qc).mul_(scale), dv


def forward(q, k, v, layout):
    """Softmax over each query's groups: out (B, H, T, D) in q's dtype, logsumexp (B, H, T) fp32. A non-finite key
    reaches only the queries that see it (_masked)."""
    qf, kf, vf = map(layout.flat, (q, k, v))  # (N, D)
    # merge: online, by the top lse so far, sum of exp(lse - top), output sum
    top = torch.full_like(qf[:, 0], NEG)  # (N,)
    total, out = torch.zeros_like(top), torch.zeros_like(qf) if layout.merge else torch.empty_like(qf)
    finite = bool(kf.sum().isfinite())  # every key; an overflow only costs speed
    fused = _fused(qf, finite, layout)
    for qrows, krows, mask in layout.calls(FUSED_CALL if fused else CALL):  # (m, n, nq), (m, n, nk), (.., nq, nk)
        qc, kc, vc = layout.query(qf, qrows), layout.keys(kf, krows), layout.keys(vf, krows)
        o, lse = _group_forward(qc, kc, vc, mask, finite, fused)
        if not layout.merge:  # written once, through views
            layout.query(out, qrows).copy_(o)
            layout.query(top[:, None], qrows)[..., 0].copy_(lse)
            continue
        rows, o, lse = qrows.flatten(), o.flatten(0, -2), lse.flatten()  # (n,), (n, D), (n,)
        seen = rows.unique()
        old = top[seen]
        top.scatter_reduce_(0, rows, lse, "amax")
        rescale = (old - top[seen]).exp_()  # earlier groups, to the new max
        total[seen] *= rescale
        out[seen] *= rescale[:, None]
        w = (lse - top[rows]).exp_()  # (n,)
        total.index_add_(0, rows, w)
        out.index_add_(0, rows, o.mul_(w[:, None]))
    if layout.merge:
        out /= total[:, None]
        top += total.log()  # each row's logsumexp
    return layout.unflat(out, q.dtype), layout.unflat(top[:, None], torch.float32)[..., 0]


@torch.autocast("cpu", enabled=False)  # fp32 scores, under autocast too
@torch.autocast("cuda", enabled=False)
def backward(dout, out, lse, q, k, v, layout):
    """dq, dk, dv (B, H, T, D) of forward's out, summed over groups."""
    qf, kf, vf, dof = map(layout.flat, (q, k, v, dout))  # (N, D)
    lse = layout.flat(lse[..., None])[:, 0]  # (N,); pads 0, their dO is 0
    dq, dk, dv = map(torch.zeros_like, (qf, kf, vf))
    finite = bool(kf.sum().isfinite())
    fused = _fused(qf, finite, layout)
    if fused:
        of = layout.flat(out)
    else:
        rowdot = layout.flat((dout.float() * out.float()).sum(-1, keepdim=True))[:, 0]  # (N,)
    for qrows, krows, mask in layout.calls(CALL):
        qc, doc = layout.query(qf, qrows), layout.query(dof, qrows)
        kc, vc = layout.keys(kf, krows), layout.keys(vf, krows)
        if fused:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                doc, qc, kc, vc, layout.query(of, qrows), lse[qrows], 0.0, False, attn_mask=mask)
        else:
            grads = _group_backward(doc, qc, kc, vc, lse[qrows], rowdot[qrows], mask, finite)
        for g, rows, grad in zip((dq, dk, dv), (qrows, krows, krows), grads):
            g.index_add_(0, rows.flatten(), grad.flatten(0, -2))
    return layout.unflat(dq, q.dtype), layout.unflat(dk, k.dtype), layout.unflat(dv, v.dtype)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*output, *inputs[:5])  # out, lse, q, k, v, the op's two tensors
    ctx.scalars = inputs[5:]


def _op(name, layout, args):
    """sa::name(q, k, v, args) -> (out, lse) over layout(q, *args), with its backward op and autograd."""
    qkv = f"Tensor q, Tensor k, Tensor v, {args}"
    fwd = torch.library.custom_op(f"sa::{name}", lambda q, k, v, *a: forward(q, k, v, layout(q, *a)), mutates_args=(),
                                  schema=f"({qkv}) -> (Tensor, Tensor)")
    bwd = torch.library.custom_op(
        f"sa::{name}_backward", lambda dout, out, lse, q, k, v, *a: backward(dout, out, lse, q, k, v, layout(q, *a)),
        mutates_args=(), schema=f"(Tensor dout, Tensor out, Tensor lse, {qkv}) -> (Tensor, Tensor, Tensor)")
    fwd.register_fake(lambda q, *_: (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)))
    bwd.register_fake(lambda dout, out, lse, *qkv: tuple(t.new_empty(t.shape) for t in qkv[:3]))
    fwd.register_autograd(lambda ctx, dout, _: (*bwd(dout, *ctx.saved_tensors, *ctx.scalars),
                                                *[None] * (2 + len(ctx.scalars))), setup_context=_save)
    return fwd


# Registered ops: opaque to torch.compile, no graph break
band = _op("band", Band, "Tensor? pos, Tensor? r, float width, float margin")
moba = _op("moba", Moba, "Tensor idx, Tensor ok, int moba_chunk")


def band_attention(q, k, v, pos, r, width, margin):
    """The band of attention.py's rule: (B, H, T, D) out in q's dtype; fp32 scores under autocast too."""
    with torch.autocast(q.device.type, enabled=False):
        return band(q, k, v, pos, r, width, margin)[0]
