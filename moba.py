"""Support, which a first reading skips: MoBA's engine (attention.moba_attention), forward and backward in O(T * chunk *
moba_topk) time and memory, on any device.

A query's keys are its own chunk's (causal) and those of the past chunks it picked (moba_select). The pairs are cut
into groups, each a tile of query rows and the one chunk of keys they see, and batched in calls whose scores fit in
cache; each query's groups are merged by their log-sum-exp, as FlashAttention merges key tiles. The backward
recomputes probabilities from each row's log-sum-exp (autograd would keep them).
"""
import math

import torch
import torch.nn.functional as F

TILE = 64  # query rows per tile
CALL = 1 << 19  # scores per call
NEG = float("-inf")  # hidden; no real row is all -inf (a real query sees itself)


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
def moba_select(q, k, moba_chunk, moba_topk):
    """MoBA's routing (fp32, no gradient, as in MoBA): (B, H, T, min(moba_topk - 1, chunks)) indices of the
    strictly-past chunks picked, and which are valid (early queries have fewer)."""
    B, H, T, D = q.shape
    nc = math.ceil(T / moba_chunk)
    kmean = chunk_means(k, moba_chunk)  # (B, H, nc, D)
    n, idx, ok = min(moba_topk - 1, nc), [], []
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


    def calls(self, size):
        c = self.own.shape[-1]
        n = max(1, size // (TILE * c))  # tiles per call
        m = max(1, n // len(self.own))  # own chunks per call
        for s in range(0, self.own.shape[1], m):  # (BH, m, c), (BH, m, c), (1, m, c, c)
            yield self.own[:, s:s + m], self.own[:, s:s + m], self.own_mask[None, s:s + m]
        for s in range(0, len(self.tile_q), n):  # (n, 1, nq), (n, 1, c), (n, 1, 1, c)
            yield self.tile_q[s:s + n, None], self.tile_k[s:s + n, None], self.tile_mask[s:s + n, None]


def _masked(s, mask, finite):
    """s plus the mask where keys are finite (fast), else filled: a hidden NaN key stays hidden."""
    return s.add_(mask) if finite else s.masked_fill_(mask == NEG, NEG)


def _group_backward(doc, qc, kc, vc, lse, rowdot, mask, finite):
    """dq, dk, dv per group, from lse (over the row's groups) and rowdot = rowsum(dO * O), in place."""
    scale = qc.shape[-1] ** -0.5
    p = _masked((qc @ kc.transpose(-1, -2)).mul_(scale), mask, finite).sub_(lse[..., None]).exp_()  # (m, n, nq, nk)
    dv = p.transpose(-1, -2) @ doc
    ds = p.mul_((doc @ vc.transpose(-1, -2)).sub_(rowdot[..., None]))  # (m, n, nq, nk): dloss/dscores
    return (ds @ kc).mul_(scale), (ds.transpose(-1, -2) @ qc).mul_(scale), dv


def forward(q, k, v, idx, ok, moba_chunk):
    """Softmax over each query's groups: out (B, H, T, D) in q's dtype, logsumexp (B, H, T) fp32. A non-finite key
    reaches only the queries that see it (_masked)."""
    groups = Moba(q, idx, ok, moba_chunk)
    qf, kf, vf = map(groups.flat, (q, k, v))  # (N, D)
    # each row's groups merged online: the top lse so far, the sum of exp(lse - top), the output's sum
    top = torch.full_like(qf[:, 0], NEG)  # (N,)
    total, out = torch.zeros_like(top), torch.zeros_like(qf)
    finite = bool(kf.sum().isfinite())  # every key; an overflow only costs speed
    for qrows, krows, mask in groups.calls(CALL):  # (m, n, nq), (m, n, nk), (.., nq, nk)
        qc, kc, vc = _gather(qf, qrows), _gather(kf, krows), _gather(vf, krows)  # (m, n, rows, D)
        # the group's softmax(qc kc^T / sqrt(D) + mask) @ vc, and its log-sum-exp
        s = _masked((qc @ kc.transpose(-1, -2)).mul_(qc.shape[-1] ** -0.5), mask, finite)  # (m, n, nq, nk)
        most = s.amax(-1, keepdim=True)  # (m, n, nq, 1): every row sees a key
        p = s.sub_(most).exp_()  # unnormalised
        total_p = p.sum(-1, keepdim=True)
        o, lse = (p @ vc).div_(total_p), (most + total_p.log()).squeeze(-1)  # (m, n, nq, D), (m, n, nq)
        # merged into each row's groups so far
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
    out /= total[:, None]
    top += total.log()  # each row's logsumexp
    return groups.unflat(out, q.dtype), groups.unflat(top[:, None], torch.float32)[..., 0]


@torch.autocast("cpu", enabled=False)  # fp32 scores, under autocast too
@torch.autocast("cuda", enabled=False)
def backward(dout, out, lse, q, k, v, idx, ok, moba_chunk):
    """dq, dk, dv (B, H, T, D) of forward's out, summed over groups."""
    groups = Moba(q, idx, ok, moba_chunk)
    qf, kf, vf, dof = map(groups.flat, (q, k, v, dout))  # (N, D)
    lse = groups.flat(lse[..., None])[:, 0]  # (N,); pads 0, their dO is 0
    dq, dk, dv = map(torch.zeros_like, (qf, kf, vf))
    finite = bool(kf.sum().isfinite())
    rowdot = groups.flat((dout.float() * out.float()).sum(-1, keepdim=True))[:, 0]  # (N,)
    for qrows, krows, mask in groups.calls(CALL):
        qc, doc, kc, vc = _gather(qf, qrows), _gather(dof, qrows), _gather(kf, krows), _gather(vf, krows)
        grads = _group_backward(doc, qc, kc, vc, lse[qrows], rowdot[qrows], mask, finite)
        for g, rows, grad in zip((dq, dk, dv), (qrows, krows, krows), grads):
            g.index_add_(0, rows.flatten(), grad.flatten(0, -2))
    return groups.unflat(dq, q.dtype), groups.unflat(dk, k.dtype), groups.unflat(dv, v.dtype)


class MobaAttention(torch.autograd.Function):
    """forward and backward, for autograd (eager calls; compiled ones call the ops below)."""

    @staticmethod
    def forward(ctx, q, k, v, idx, ok, moba_chunk):
        out, lse = forward(q, k, v, idx, ok, moba_chunk)
        ctx.save_for_backward(out, lse, q, k, v, idx, ok)
        ctx.moba_chunk = moba_chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        return *backward(dout, *ctx.saved_tensors, ctx.moba_chunk), None, None, None


# forward and backward as registered ops, opaque to torch.compile: a compiled model has no graph break
moba = torch.library.custom_op(
    "sa::moba", forward, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor idx, Tensor ok, int moba_chunk) -> (Tensor, Tensor)")
moba_backward = torch.library.custom_op(
    "sa::moba_backward", backward, mutates_args=(), schema="(Tensor dout, Tensor out, Tensor lse, Tensor q, "
    "Tensor k, Tensor v, Tensor idx, Tensor ok, int moba_chunk) -> (Tensor, Tensor, Tensor)")
moba.register_fake(lambda q, *_: (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)))
moba_backward.register_fake(lambda dout, out, lse, q, k, v, *_: (q.new_empty(q.shape), k.new_empty(k.shape),
                                                                    v.new_empty(v.shape)))


def _save(ctx, inputs, output):
    ctx.save_for_backward(*output, *inputs[:5])  # out, lse, q, k, v, idx, ok
    ctx.moba_chunk = inputs[5]


def _moba_grads(ctx, dout, _):
    return *moba_backward(dout, *ctx.saved_tensors, ctx.moba_chunk), None, None, None


moba.register_autograd(_moba_grads, setup_context=_save)


def run(q, k, v, idx, ok, moba_chunk):
    """MoBA's output (B, H, T, D): the autograd.Function eagerly, the op compiled."""
    if torch.compiler.is_compiling():
        return moba(q, k, v, idx, ok, moba_chunk)[0]
    return MobaAttention.apply(q, k, v, idx, ok, moba_chunk)


def attention(q, k, v, idx, ok, moba_chunk):
    """MoBA over the routing idx, ok (moba_select): (B, H, T, D) in q's dtype, fp32 scores under autocast too. On the
    CPU, eagerly, a non-finite v[j, d] reaches out[i, d] only where query i sees key j: the engine run once more on
    q = k = 0 (each visible key weighs >= 1/T) and v's bad entries finds them. Not compiled, nor on a GPU (a wait)."""
    with torch.autocast(q.device.type, enabled=False):
        if q.numel() == 0:  # the empty output, on the autograd graph
            return q.new_zeros(*q.shape[:3], v.shape[3]) + (q.sum() + k.sum() + v.sum())
        if q.device.type != "cpu" or torch.compiler.is_compiling() or bool(v.isfinite().all()):
            return run(q, k, v, idx, ok, moba_chunk)
        bad = ~v.isfinite()  # (B, H, T, D)
        with torch.no_grad():
            seen = run(torch.zeros_like(q), torch.zeros_like(k), bad.to(v.dtype), idx, ok, moba_chunk) > 0
        return run(q, k, v.masked_fill(bad, 0), idx, ok, moba_chunk).masked_fill(seen, math.nan)  # (B, H, T, D)
