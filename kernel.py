"""Sliding-window attention in Triton, forward and backward, with SA's permutation inside: triton_swa(q, k, v,
width, perm, r). The support comes first: a first reading may start at _fwd_inner.

As in Triton's fused-attention tutorial, a forward program streams the key tiles its TILE_M query slots' band reaches,
online softmax in fp32: O(T * w). The programs read q, k, v and write out, dq, dk, dv through perm: SA is one launch
forward and two backward, no copy in slot order. No repo imports. The rules are attention.py's, each checked against a
dense one at its first use on a device, dtype and head dim (check_once), by the binary training runs. Variants
(Tiling's switches) wait for a GPU run to pick them (results/gpu_check.py's sweep, then TUNED)."""
import functools
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

SELF_CHECK = True  # False: the kernel runs unchecked
HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # scores pre-scaled for exp2


class Unsupported(ValueError):
    """The kernel declines this GPU, dtype or shape, or failed its self-check on it."""


CANNOT_RUN = (Unsupported, triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources,
              getattr(triton.runtime.errors, "PTXASError", triton.runtime.errors.OutOfResources))


# Kernels

@triton.jit
def _search(R, x, T):
    """The first slot j with R[j] >= x (T if none), R ascending: torch.searchsorted's, by bisection."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + T
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(R + mid) < x
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _span(start, TILE_FIXED: tl.constexpr, TILE_LOOP: tl.constexpr, before, after, T, R, Spans, width, margin,
          HAS_R: tl.constexpr, SPANS_FIRST: tl.constexpr):
    """Moving slots x < T meet fixed slots y in [start, start + TILE_FIXED) iff y - before <= x <= y + after: [lo, hi)
    on the TILE_LOOP grid, [mid_lo, mid_hi) in every y's band. With r: iff |r_x - r_y| < width, within width + margin
    (fp32 rounding) of the tile's least and greatest r, its own slots in (SPANS_FIRST: as _value_spans found it)."""
    if HAS_R:
        if SPANS_FIRST:
            lo, hi = tl.load(Spans + 2 * tl.program_id(0)), tl.load(Spans + 2 * tl.program_id(0) + 1)
        else:
            last = tl.minimum(start + TILE_FIXED, T) - 1
            lo = _search(R, tl.load(R + start) - width - margin, T) // TILE_LOOP * TILE_LOOP
            hi = tl.maximum(_search(R, tl.load(R + last) + width + margin, T), last + 1)
        mid_lo, mid_hi = hi, hi
    else:
        lo = tl.maximum(start - before, 0) // TILE_LOOP * TILE_LOOP
        hi = tl.minimum(start + TILE_FIXED + after, T)
        mid_lo = tl.minimum(tl.cdiv(tl.maximum(start + TILE_FIXED - 1 - before, 0), TILE_LOOP) * TILE_LOOP, hi)
        mid_hi = tl.maximum(tl.minimum(start + after + 1, T) // TILE_LOOP * TILE_LOOP, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _region(region: tl.constexpr, lo, mid_lo, mid_hi, hi, ONE_LOOP: tl.constexpr):
    """Region 0, 1 or 2 of a span: the left edge, the interior, the right edge; ONE_LOOP: the whole span, one region."""
    if ONE_LOOP:
        return lo, hi
    return (lo, mid_lo) if region == 0 else (mid_lo, mid_hi) if region == 1 else (mid_hi, hi)


@triton.jit
def _tokens(Perm, slots, T, HAS_PERM: tl.constexpr):
    """The token each slot holds, int32: perm[slot] (SA), else the slot itself (SWA)."""
    if HAS_PERM:
        return tl.load(Perm + slots, mask=slots < T, other=0).to(tl.int32)
    return slots


@triton.jit
def _rows(X, tokens, slots, stride, T, D: tl.constexpr, EDGE: tl.constexpr):
    """X's rows (len(slots), D) of the tokens at these slots; slots past T (at an edge only) read as 0. Row offsets are
    int32 (triton_swa keeps T * stride < 2**31): int64 spilled here, int32 in _attn_fwd's store (kernel_compile.txt)."""
    ptrs = X + tokens[:, None] * stride + tl.arange(0, D)[None, :]
    if EDGE:
        return tl.load(ptrs, mask=slots[:, None] < T, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _mask(s, qi, kj, tok_q, tok_k, r_q, r_k, left, right, width, T,
          EDGE: tl.constexpr, HAS_PERM: tl.constexpr, HAS_R: tl.constexpr):
    """s where key slot kj is visible to query slot qi, else -inf: qi - left <= kj <= qi + right (with r: |r_q - r_k|
    < width), and token tok_k <= tok_q (SA: causal on the tokens). A masked NaN score reaches no sum."""
    if HAS_R:
        s = tl.where((tl.abs(r_q - r_k) < width) & (kj < T), s, float("-inf"))
    elif EDGE:
        s = tl.where((qi - kj <= left) & (kj - qi <= right) & (kj < T), s, float("-inf"))
    if HAS_PERM:
        s = tl.where(tok_k <= tok_q, s, float("-inf"))
    return s


@triton.jit
def _key_tile(q, offs_m, tok_m, r_m, start_n, K, V, Perm, R, sk_t, sv_t, left, right, width, T, qk_scale,
              D: tl.constexpr, TILE_N: tl.constexpr, EDGE: tl.constexpr, HAS_PERM: tl.constexpr, HAS_R: tl.constexpr,
              PRECISION: tl.constexpr):
    """The key tile at slot start_n: k, v, and q's scores in log2 units, -inf where masked."""
    offs_n = start_n + tl.arange(0, TILE_N)  # key slots
    tok_n = _tokens(Perm, offs_n, T, HAS_PERM)
    k, v = _rows(K, tok_n, offs_n, sk_t, T, D, EDGE), _rows(V, tok_n, offs_n, sv_t, T, D, EDGE)
    r_n = tl.load(R + offs_n, mask=offs_n < T, other=0.0) if HAS_R else r_m
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (TILE_M, TILE_N)
    return k, v, _mask(s, offs_m[:, None], offs_n[None, :], tok_m[:, None], tok_n[None, :], r_m[:, None],
                       r_n[None, :], left, right, width, T, EDGE, HAS_PERM, HAS_R)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, offs_m, tok_m, r_m, K, V, Perm, R, sk_t, sv_t, lo, hi, left, right, width, T,
               qk_scale, D: tl.constexpr, TILE_N: tl.constexpr, EDGE: tl.constexpr, HAS_PERM: tl.constexpr,
               HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the key tiles in [lo, hi): acc / l_i is the output so far."""
    for start_n in range(lo, hi, TILE_N):
        k, v, s = _key_tile(q, offs_m, tok_m, r_m, start_n, K, V, Perm, R, sk_t, sv_t, left, right, width, T,
                            qk_scale, D, TILE_N, EDGE, HAS_PERM, HAS_R, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # 1. the new running max of each row
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # only masked keys so far: subtract 0, not -inf
        p = tl.math.exp2(s - m_sub[:, None])  # 2. unnormalised, <= 1; masked keys give 0
        alpha = tl.math.exp2(m_i - m_sub)  # 3. rescale the sums so far, add this tile
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _head(X, b, h, stride_b, stride_h):
    return X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _program(TILE: tl.constexpr, T, H):
    """This program's first slot, batch b, head h, and bh = b * H + h. The grid is one-dimensional, tiles fastest (as
    the tutorial's (tiles, B * H)): a second dimension of B * H would stop at 65,535."""
    tiles = tl.cdiv(T, TILE)
    bh = tl.program_id(0) // tiles
    return tl.program_id(0) % tiles * TILE, bh // H, bh % H, bh


# Integer arguments Triton is not to specialise (on divisibility by 16, and on 1): one binary for every head count and
# window, so that the self-check (at check_size's T, a multiple of 16 as training's) runs the binary a call runs. They
# only bound masks and index heads. (perm's strides, sp_b and sp_h, are 0 or multiples of T: a multiple of 16 too.)
ANY = ["H", "left", "right"]


@triton.jit(do_not_specialize=ANY)
def _attn_fwd(Q, K, V, O, LSE, Perm, R, Spans, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
              sp_b, sp_h, H, T, left, right, width, margin, qk_scale,
              D: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr, HAS_PERM: tl.constexpr,
              HAS_R: tl.constexpr, ONE_LOOP: tl.constexpr, SPANS_FIRST: tl.constexpr, PRECISION: tl.constexpr):
    """Program (tile, bh): the output of query slots [tile, tile + TILE_M) of head bh."""
    # 1. this program's head and query rows, read through perm
    start_m, b, h, bh = _program(TILE_M, T, H)
    Q, K, V = _head(Q, b, h, sq_b, sq_h), _head(K, b, h, sk_b, sk_h), _head(V, b, h, sv_b, sv_h)
    O = _head(O, b, h, so_b, so_h)
    Perm, R, LSE = _head(Perm, b, h, sp_b, sp_h), _head(R, b, h, sp_b, sp_h), LSE + bh.to(tl.int64) * T
    offs_m = start_m + tl.arange(0, TILE_M)  # query slots
    tok_m = _tokens(Perm, offs_m, T, HAS_PERM)  # their tokens: rows read and written, causal positions
    q = _rows(Q, tok_m, offs_m, sq_t, T, D, True)
    r_m = tl.load(R + offs_m, mask=offs_m < T, other=0.0) if HAS_R else tl.zeros([TILE_M], dtype=tl.float32)
    # 2. online softmax over the key tiles the band reaches
    acc = tl.zeros([TILE_M, D], dtype=tl.float32)
    l_i, m_i = tl.zeros([TILE_M], dtype=tl.float32), tl.zeros([TILE_M], dtype=tl.float32) + float("-inf")
    lo, mid_lo, mid_hi, hi = _span(start_m, TILE_M, TILE_N, left, right, T, R, Spans, width, margin, HAS_R, SPANS_FIRST)
    for region in tl.static_range(1 if ONE_LOOP else 3):  # left edge, interior (no band mask or bounds checks), right
        first, end = _region(region, lo, mid_lo, mid_hi, hi, ONE_LOOP)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, tok_m, r_m, K, V, Perm, R, sk_t, sv_t, first, end,
                                   left, right, width, T, qk_scale, D, TILE_N, ONE_LOOP or region != 1, HAS_PERM,
                                   HAS_R, PRECISION)
    # 3. the output, and each slot's log2-sum-exp2 for the backward
    tl.store(LSE + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)
    tl.store(O + tok_m.to(tl.int64)[:, None] * so_t + tl.arange(0, D)[None, :],  # int64: int32 spilled here (_rows)
             (acc / l_i[:, None]).to(O.dtype.element_ty), mask=offs_m[:, None] < T)


@triton.jit(do_not_specialize=ANY)
def _value_spans(R, Spans, sp_b, sp_h, H, T, width, margin, TILE_FIXED: tl.constexpr, TILE_LOOP: tl.constexpr):
    """SPANS_FIRST's launch before the attention launch of the same grid: each of its programs' key spans [lo, hi)
    under the value rule, by _span's bisections, at Spans[2 * program id]."""
    start, b, h, _ = _program(TILE_FIXED, T, H)
    lo, _, _, hi = _span(start, TILE_FIXED, TILE_LOOP, 0, 0, T, _head(R, b, h, sp_b, sp_h), Spans, width, margin, True,
                         False)
    tl.store(Spans + 2 * tl.program_id(0), lo)
    tl.store(Spans + 2 * tl.program_id(0) + 1, hi)


@triton.jit(do_not_specialize=ANY)
def _rowdot(O, DO, RowDot, Perm, so_b, so_h, so_t, sp_b, sp_h, H, T,
            D: tl.constexpr, TILE: tl.constexpr, HAS_PERM: tl.constexpr):
    """The backward's first step: rowsum(dO * O) of each slot's row, fp32 (FlashAttention's D_i)."""
    start, b, h, bh = _program(TILE, T, H)
    slots = start + tl.arange(0, TILE)
    O, DO, Perm = _head(O, b, h, so_b, so_h), _head(DO, b, h, so_b, so_h), _head(Perm, b, h, sp_b, sp_h)
    tok = _tokens(Perm, slots, T, HAS_PERM)
    o, do = _rows(O, tok, slots, so_t, T, D, True), _rows(DO, tok, slots, so_t, T, D, True)
    tl.store(RowDot + bh.to(tl.int64) * T + slots, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=slots < T)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, offs_n, tok_n, r_n, Q, DO, DQ, LSE, RowDot, Perm, R, sq_t, so_t, lo, hi, left, right,
                    width, T, qk_scale, sm_scale, D: tl.constexpr, TILE_M: tl.constexpr, EDGE: tl.constexpr,
                    HAS_PERM: tl.constexpr, HAS_R: tl.constexpr, DQ_ATOMIC: tl.constexpr, PRECISION: tl.constexpr):
    """Fixed key tile, moving query tiles; keys along rows. DQ_ATOMIC: each query tile's share of dQ too, added to DQ
    (fp32) by atomics in no fixed order (FlashAttention-2's backward: 5 dots a step, where two loops take 7)."""
    for start_m in range(lo, hi, TILE_M):
        offs_m = start_m + tl.arange(0, TILE_M)  # query slots
        tok_m = _tokens(Perm, offs_m, T, HAS_PERM)
        q, do = _rows(Q, tok_m, offs_m, sq_t, T, D, EDGE), _rows(DO, tok_m, offs_m, so_t, T, D, EDGE)
        lse = tl.load(LSE + offs_m, mask=offs_m < T, other=0.0)
        rowdot = tl.load(RowDot + offs_m, mask=offs_m < T, other=0.0)
        r_m = tl.load(R + offs_m, mask=offs_m < T, other=0.0) if HAS_R else r_n
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (TILE_FIXED, TILE_M)
        sT = _mask(sT, offs_m[None, :], offs_n[:, None], tok_m[None, :], tok_n[:, None], r_m[None, :], r_n[:, None],
                   left, right, width, T, EDGE, HAS_PERM, HAS_R)
        pT = tl.math.exp2(tl.minimum(sT - lse[None, :], 0.0))  # <= 1: at |s| ~ 1e9, s may exceed lse
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - rowdot[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=PRECISION) * sm_scale  # (TILE_M, D)
            tl.atomic_add(DQ + tok_m[:, None] * so_t + tl.arange(0, D)[None, :], dq, mask=offs_m[:, None] < T,
                          sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, rowdot, offs_m, tok_m, r_m, K, V, Perm, R, sk_t, sv_t, lo, hi, left, right, width,
                  T, qk_scale, D: tl.constexpr, TILE_N: tl.constexpr, EDGE: tl.constexpr, HAS_PERM: tl.constexpr,
                  HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    """Fixed query tile, moving key tiles: dQ, added to dq (fp32) tile by tile."""
    for start_n in range(lo, hi, TILE_N):
        k, v, s = _key_tile(q, offs_m, tok_m, r_m, start_n, K, V, Perm, R, sk_t, sv_t, left, right, width, T,
                            qk_scale, D, TILE_N, EDGE, HAS_PERM, HAS_R, PRECISION)
        p = tl.math.exp2(tl.minimum(s - lse[:, None], 0.0))
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - rowdot[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit(do_not_specialize=ANY)
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, LSE, RowDot, Perm, R, Spans, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h,
              sv_t, so_b, so_h, so_t, sp_b, sp_h, H, T, left, right, width, margin, qk_scale, sm_scale,
              D: tl.constexpr, TILE_FIXED: tl.constexpr, TILE_LOOP: tl.constexpr, HAS_PERM: tl.constexpr,
              HAS_R: tl.constexpr, ONE_LOOP: tl.constexpr, SPANS_FIRST: tl.constexpr, DQ_ATOMIC: tl.constexpr,
              PRECISION: tl.constexpr):
    """Program (tile, bh): dK, dV of key slots [tile, tile + TILE_FIXED), then dQ of the same query slots (DQ_ATOMIC:
    every query's share from these keys, into DQ, zeroed fp32). DO, DQ, DK, DV share O's strides."""
    start, b, h, bh = _program(TILE_FIXED, T, H)
    Q, K, V = _head(Q, b, h, sq_b, sq_h), _head(K, b, h, sk_b, sk_h), _head(V, b, h, sv_b, sv_h)
    DO, DQ = _head(DO, b, h, so_b, so_h), _head(DQ, b, h, so_b, so_h)
    DK, DV = _head(DK, b, h, so_b, so_h), _head(DV, b, h, so_b, so_h)
    LSE, RowDot = LSE + bh.to(tl.int64) * T, RowDot + bh.to(tl.int64) * T
    Perm, R = _head(Perm, b, h, sp_b, sp_h), _head(R, b, h, sp_b, sp_h)
    slots = start + tl.arange(0, TILE_FIXED)
    tok = _tokens(Perm, slots, T, HAS_PERM)
    r = tl.load(R + slots, mask=slots < T, other=0.0) if HAS_R else tl.zeros([TILE_FIXED], dtype=tl.float32)
    # 1. dK, dV: query x reaches key y iff y - right <= x <= y + left
    k, v = _rows(K, tok, slots, sk_t, T, D, True), _rows(V, tok, slots, sv_t, T, D, True)
    dk, dv = tl.zeros([TILE_FIXED, D], dtype=tl.float32), tl.zeros([TILE_FIXED, D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _span(start, TILE_FIXED, TILE_LOOP, right, left, T, R, Spans, width, margin, HAS_R,
                                   SPANS_FIRST)
    for region in tl.static_range(1 if ONE_LOOP else 3):
        first, end = _region(region, lo, mid_lo, mid_hi, hi, ONE_LOOP)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, slots, tok, r, Q, DO, DQ, LSE, RowDot, Perm, R, sq_t, so_t, first, end,
                                 left, right, width, T, qk_scale, sm_scale, D, TILE_LOOP, ONE_LOOP or region != 1,
                                 HAS_PERM, HAS_R, DQ_ATOMIC, PRECISION)
    at = tok[:, None] * so_t + tl.arange(0, D)[None, :]  # (TILE_FIXED, D): their rows in DK, DV, DQ
    tl.store(DK + at, (dk * sm_scale).to(DK.dtype.element_ty), mask=slots[:, None] < T)
    tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=slots[:, None] < T)
    # 2. dQ of the same slots as queries: key y reaches query x iff x - left <= y <= x + right
    if not DQ_ATOMIC:
        q, do = _rows(Q, tok, slots, sq_t, T, D, True), _rows(DO, tok, slots, so_t, T, D, True)
        lse = tl.load(LSE + slots, mask=slots < T, other=0.0)
        rowdot = tl.load(RowDot + slots, mask=slots < T, other=0.0)
        dq = tl.zeros([TILE_FIXED, D], dtype=tl.float32)
        lo, mid_lo, mid_hi, hi = _span(start, TILE_FIXED, TILE_LOOP, left, right, T, R, Spans, width, margin, HAS_R,
                                       SPANS_FIRST)
        for region in tl.static_range(1 if ONE_LOOP else 3):
            first, end = _region(region, lo, mid_lo, mid_hi, hi, ONE_LOOP)
            dq = _bwd_dq_inner(dq, q, do, lse, rowdot, slots, tok, r, K, V, Perm, R, sk_t, sv_t, first, end, left,
                               right, width, T, qk_scale, D, TILE_LOOP, ONE_LOOP or region != 1, HAS_PERM, HAS_R,
                               PRECISION)
        tl.store(DQ + at, (dq * sm_scale).to(DQ.dtype.element_ty), mask=slots[:, None] < T)


# Host

class Target(NamedTuple):
    platform: str  # "cuda" or "hip" (ROCm)
    arch: object  # 80 for sm_80, or "gfx942"
    max_shared: int  # bytes of shared memory a program may opt into


class Tiling(NamedTuple):
    tile_m: int  # forward: query rows per program
    tile_n: int  # forward: keys per step
    tile_fixed: int  # backward: rows per program (keys, queries)
    tile_loop: int  # backward: rows per step
    num_warps: int  # the forward's (and the backward's, unless bwd_warps)
    num_stages: int  # the forward's (and the backward's, unless bwd_stages)
    precision: str  # tl.dot input_precision for fp32
    min_shared_kb: int  # KB of shared memory the GPU must offer: the kernels' measured use plus a reserve
    bwd_warps: int = 0  # the backward's num_warps, if not the forward's
    bwd_stages: int = 0  # the backward's num_stages, if not the forward's
    # the kernels' variants, off until a GPU run picks one (results/gpu_check.py's sweep times each)
    one_loop: bool = False  # one masked loop per direction, not three runs (left edge, interior, right edge)
    dq_atomic: bool = False  # FlashAttention-2's backward: dQ by fp32 atomics in the dK, dV loop; not deterministic
    spans_first: bool = False  # the value rule's key spans by a launch of their own (_value_spans), not per program


INTERPRETER = Target("cuda", 80, 163 * 1024)
# A GPU run's picks (results/gpu_check.py's sweep), by (platform, arch, dtype, D): ((longest T, Tiling), ...), shortest
# first; choose_tiling's tiling beyond them. Empty: no GPU run has chosen one yet.
TUNED = {}


def device_target(device):
    return _cuda_target(device) if device.type == "cuda" else INTERPRETER


@functools.lru_cache  # Triton's device query took 0.9 ms a call on an H200
def _cuda_target(device):
    with torch.cuda.device(device):
        driver = triton.runtime.driver.active
        target, props = driver.get_current_target(), driver.utils.get_device_properties(torch.cuda.current_device())
    return Target(target.backend, target.arch, props["max_shared_mem"])


@functools.lru_cache
def choose_tiling(dtype, D, target):
    """The largest tiles found to compile without fp16/bf16 spills on sm_80 to sm_90, within min_shared_kb."""
    if target.platform == "cuda" and target.arch < 80:
        raise Unsupported(f"sm_{target.arch}: Triton {triton.__version__} has no tensor-core dot below sm_80: the "
                          "kernel would spill registers")
    amd, small = target.platform == "hip", D <= 64  # gfx942: 64 KB LDS, 64-thread warps
    if dtype == torch.float32:  # 2x bytes, tf32x3's 3 passes: small tiles
        tiling = Tiling(*(32, 32, 32, 32) if small else (16, 32, 16, 32), 4, 2, "ieee" if amd else "tf32x3",
                        64 if small else 80)
    else:
        tiling = Tiling(*(128, 64, 128, 32) if small else (128, 32, 64, 32), 8, 3, None, 72 if small else 96)
    if amd:  # fp16 value rule's forward at D = 64: 128 query rows spill; at D = 128, 32 moving rows
        tiling = tiling._replace(tile_m=64 if small else tiling.tile_m, tile_loop=tiling.tile_loop if small else 16,
                                 num_warps=4, num_stages=2, min_shared_kb=64)
    if target.max_shared < tiling.min_shared_kb * 1024:
        raise Unsupported(f"the kernel for {str(dtype)[6:]} at head dim {D} needs {tiling.min_shared_kb} KB of shared "
                          f"memory, the GPU offers {target.max_shared // 1024} KB")
    return tiling


def tiling_for(dtype, D, target, T):
    """The tiling a call of length T runs: TUNED's first that reaches T, else choose_tiling's."""
    default = choose_tiling(dtype, D, target)  # Unsupported where the GPU has none
    return next((t for longest, t in TUNED.get((target.platform, target.arch, dtype, D), ()) if T <= longest), default)


def tilings(dtype, D, target):
    """Every tiling a call may run at this dtype and head dim (tiling_for's), each once."""
    listed = TUNED.get((target.platform, target.arch, dtype, D), ())
    return list(dict.fromkeys([choose_tiling(dtype, D, target), *(t for _, t in listed)]))


def band_edges(window, T, two_sided):  # attention.py's window, written again (test_kernel.py: the rule's)
    left = min(int(window), T) - 1
    return left, left if two_sided else 0


def _perm_strides(perm):
    """perm's (and r's) strides along B and H, 0 where it broadcasts."""
    return [perm.stride(i) if perm.shape[i] > 1 else 0 for i in (0, 1)] if perm is not None and perm.dim() == 3 \
        else [0, 0]


def _launch(q, k, v, o, perm, r, width, margin, tiling, tiles):
    """The kernels' arguments Perm .. margin (after the tensors) and options, for programs of tiles = (rows, rows per
    step); o: O's, dO's .. strides. With r and tiling.spans_first, _value_spans finds the programs' key spans now."""
    B, H, T, D = q.shape
    left, right = band_edges(width, T, perm is not None) if r is None else (0, 0)
    spans_first, spans = tiling.spans_first and r is not None, q  # q: a pointer no kernel reads
    if spans_first:
        spans = torch.empty(2 * triton.cdiv(T, tiles[0]) * B * H, dtype=torch.int32, device=q.device)
        _value_spans[(spans.numel() // 2,)](r, spans, *_perm_strides(perm), H, T, width, margin, TILE_FIXED=tiles[0],
                                            TILE_LOOP=tiles[1], num_warps=1)
    options = dict(D=D, HAS_PERM=perm is not None, HAS_R=r is not None, ONE_LOOP=tiling.one_loop,
                   SPANS_FIRST=spans_first, PRECISION=tiling.precision, num_warps=tiling.num_warps,
                   num_stages=tiling.num_stages)
    return (q if perm is None else perm, q if r is None else r, spans, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *o.stride()[:3], *_perm_strides(perm), H, T, left, right, width, margin), options


def _token_major(q):
    """An empty tensor of q's shape (B, H, T, D) laid out as (B, T, H, D): y.transpose(1, 2).view(B, T, C) is free."""
    B, H, T, D = q.shape
    return torch.empty_strided(q.shape, (T * H * D, D, H * D, 1), dtype=q.dtype, device=q.device)


def _forward(q, k, v, perm, r, width, margin, tiling):
    """out (B, H, T, D), token-major, and each slot's log2-sum-exp2 (B, H, T) fp32, by this tiling."""
    B, H, T, D = q.shape
    o, lse = _token_major(q), q.new_empty((B, H, T), dtype=torch.float32)
    with torch.cuda.device(q.device if q.is_cuda else -1):  # q's GPU, not the current one
        args, options = _launch(q, k, v, o, perm, r, width, margin, tiling, (tiling.tile_m, tiling.tile_n))
        _attn_fwd[(triton.cdiv(T, tiling.tile_m) * B * H,)](
            q, k, v, o, lse, *args, LOG2E / math.sqrt(D), TILE_M=tiling.tile_m, TILE_N=tiling.tile_n, **options)
    return o, lse


def _backward(dout, q, k, v, out, lse, perm, r, width, margin, tiling):
    """dq, dk, dv, token-major as out, by this tiling."""
    B, H, T, D = q.shape
    if dout.stride() != out.stride():  # the kernels read dO with O's strides
        dout = torch.empty_like(out).copy_(dout)
    dq = torch.zeros_like(out, dtype=torch.float32) if tiling.dq_atomic else torch.empty_like(out)  # atomics add to it
    dk, dv, rowdot = torch.empty_like(out), torch.empty_like(out), torch.empty_like(lse)  # token-major, as out
    grid = (triton.cdiv(T, tiling.tile_fixed) * B * H,)
    with torch.cuda.device(q.device if q.is_cuda else -1):
        args, options = _launch(q, k, v, out, perm, r, width, margin, tiling, (tiling.tile_fixed, tiling.tile_loop))
        _rowdot[grid](out, dout, rowdot, args[0], *out.stride()[:3], *_perm_strides(perm), H, T, D=D,
                      TILE=tiling.tile_fixed, HAS_PERM=perm is not None)
        options.update(num_warps=tiling.bwd_warps or tiling.num_warps,
                       num_stages=tiling.bwd_stages or tiling.num_stages)
        _attn_bwd[grid](q, k, v, dout, dq, dk, dv, lse, rowdot, *args, LOG2E / math.sqrt(D), 1 / math.sqrt(D),
                        TILE_FIXED=tiling.tile_fixed, TILE_LOOP=tiling.tile_loop, DQ_ATOMIC=tiling.dq_atomic, **options)
    return dq.to(q.dtype), dk, dv


def _tiling(q):
    return tiling_for(q.dtype, q.shape[-1], device_target(q.device), q.shape[2])


def _fwd(q: Tensor, k: Tensor, v: Tensor, perm: Optional[Tensor], r: Optional[Tensor], width: float,
         margin: float) -> tuple[Tensor, Tensor]:
    """check_once, then _forward by the tiling for q's GPU and length."""
    check_once(q.device, q.dtype, q.shape[-1], RULES[(perm is not None) + (r is not None)], margin)
    return _forward(q, k, v, perm, r, width, margin, _tiling(q))


def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, perm: Optional[Tensor],
         r: Optional[Tensor], width: float, margin: float) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse, perm, r, width, margin, _tiling(q))


def _save(ctx, inputs, output):
    """Both autograds keep _fwd's inputs (q, k, v, perm, r, width, margin) and outputs as _bwd reads them."""
    ctx.save_for_backward(*inputs[:3], *output, *inputs[3:5])  # _bwd's q .. r
    ctx.scalars = inputs[5:7]


class _Band(torch.autograd.Function):
    """Eager autograd: 5 us of host time a forward, where the op below takes 36 (a 2-core EPYC)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _fwd(*inputs)
        _save(ctx, inputs, output)
        return output[0]

    @staticmethod
    def backward(ctx, dout):
        return *_bwd(dout, *ctx.saved_tensors, *ctx.scalars), None, None, None, None


# torch.compile: the same functions as ops it cannot look into
_fwd_op = torch.library.custom_op("sa::triton_swa", _fwd, mutates_args=())
_bwd_op = torch.library.custom_op("sa::triton_swa_backward", _bwd, mutates_args=())
_fwd_op.register_fake(lambda q, *_: (_token_major(q), q.new_empty(q.shape[:3], dtype=torch.float32)))
_bwd_op.register_fake(lambda dout, q, k, v, out, *_: tuple(torch.empty_like(out) for _ in range(3)))
_fwd_op.register_autograd(lambda ctx, dout, _: (*_bwd_op(dout, *ctx.saved_tensors, *ctx.scalars), *[None] * 4),
                          setup_context=_save)

RULES = ("swa", "sa rank", "sa value")  # no perm (causal SWA); perm; perm and r


def triton_swa(q, k, v, width, perm=None, r=None, margin=0.0):
    """(B, H, T, D) -> (B, H, T, D), laid out as (B, T, H, D). Without perm: key j is visible to query i iff
    i - width < j <= i. With perm (T,) or broadcastable to (B, H, T), slot s holding token perm[s]: token perm[t] is
    visible to token perm[s] iff perm[t] <= perm[s] and |s - t| < width, or with r (fp32, perm's shape: slot s's value)
    |r[s] - r[t]| < width, key spans `margin` wider. Every call assumes (unchecked: a check would wait for the GPU):
    perm a permutation of range(T) in each row (else interior tiles, loaded unmasked, read and write out of bounds); r
    ascending along T (else key spans miss keys) and in [0, 1) (margin covers fp32's rounding there). Eagerly
    attention.py refuses a perm that is no permutation (guards.check_inputs) and sorts r; compiled, it checks no value,
    and the repo's compiled calls pass the model's own draws (model.sa_draw: randperm or argsort, r by torch.rand)."""
    B, H, T, D = q.shape  # a head dim or dtype without a kernel: Unsupported by check_once
    if any((t.shape, t.dtype, t.device) != (q.shape, q.dtype, q.device) for t in (k, v)):
        raise ValueError(f"q, k, v must share one shape, device and dtype, got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in (q, k, v)]}")
    if perm is not None and not (perm.dtype == torch.long and perm.device == q.device and perm.dim() in (1, 3)
                                 and perm.shape[-1] == T and all(a in (1, b) for a, b in zip(perm.shape[:-1], (B, H)))):
        raise ValueError(f"perm must be a LongTensor on {q.device} of shape (T,) or broadcastable to (B, H, T)=({B}, "
                         f"{H}, {T}), got {perm.dtype} {tuple(perm.shape)} on {perm.device}")
    if r is not None and (perm is None or (r.dtype, r.shape, r.device) != (torch.float32, perm.shape, q.device)
                          or not width > 0):
        raise ValueError(f"r must be fp32 with perm's shape, and the width > 0; got {r.dtype} {tuple(r.shape)}, perm "
                         f"{None if perm is None else tuple(perm.shape)}, width {width!r}")
    if T * H * D >= 2**31:
        raise Unsupported(f"triton_swa's int32 row offsets need T * H * D < 2**31, got {T} * {H} * {D}")
    q, k, v = (t if t.stride(-1) == 1 and T * t.stride(2) < 2**31 else t.contiguous() for t in (q, k, v))
    perm, r = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (perm, r))
    if r is not None and r.stride() != perm.stride():  # the kernels read r with perm's strides
        perm, r = perm.contiguous(), r.contiguous()
    if torch.compiler.is_compiling():  # an op torch.compile keeps whole
        return _fwd_op(q, k, v, perm, r, float(width), float(margin))[0]
    return _Band.apply(q, k, v, perm, r, float(width), float(margin))


# The self-check

TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-2, torch.float32: 1e-3}
SELF_CHECKS = {}  # (device, dtype, D, rule) -> max error


def dense(q, k, v, width, perm=None, r=None, dout=None):
    """triton_swa's rule in token order, dense, fp32: out, and with dout dq, dk, dv (no autograd in an op)."""
    idx = torch.arange(q.shape[2], device=q.device)
    slot = idx if perm is None else perm.argsort(-1)  # each token's slot
    at = slot if r is None else r.gather(-1, slot)  # each token's place in the band: its slot, or its r
    mask = ((at[..., :, None] - at[..., None, :]).abs() < width) & (idx[None, :] <= idx[:, None])
    q, k, v, scale = q.float(), k.float(), v.float(), q.shape[-1] ** -0.5
    p = torch.softmax((q @ k.mT * scale).masked_fill(~mask, float("-inf")), -1)  # (B, H, T, T)
    out = p @ v  # (B, H, T, D)
    if dout is None:
        return out
    do = dout.float()
    ds = p * (do @ v.mT - (do * out).sum(-1, keepdim=True))  # dloss/dscores
    return out, ds @ k * scale, ds.mT @ q * scale, p.mT @ do


def check_size(tiling):
    """(T, window) at which this tiling's programs meet every region of their loops, forward and backward: left edge,
    interior, right edge (tests/test_kernel.py counts them). T is a multiple of 16, as training's: Triton specialises
    an integer argument on that, so T's is the binary training runs; and no multiple of 32, so the last tile is cut."""
    window = 2 * max(tiling.tile_m, tiling.tile_fixed) + max(tiling.tile_n, tiling.tile_loop)
    return -(-(window + 2 * max(tiling[:4])) // 32) * 32 + 16, window


def self_check(device, dtype, D, rule, T=None, window=None, B=2, H=2, margin=0.0, seed=0):
    """Max |error| of the kernel's out, dq, dk, dv / max(1, |dense's|), NaN as inf, on random input laid out as a
    model's, by every tiling a call may run, at check_size's T and window unless given; SA's rules with one perm for
    all heads and with one per head."""
    g, errors = torch.Generator().manual_seed(seed), []
    for tiling in tilings(dtype, D, device_target(device)):
        n, w = (T, window) if T else check_size(tiling)
        q, k, v = torch.randn(B, n, 3, H, D, generator=g).to(device, dtype).permute(2, 0, 3, 1, 4)  # (B, H, n, D) each
        do = _token_major(q).copy_(torch.randn(B, H, n, D, generator=g))  # laid out as out, as in training
        for shape in [(n,)] + [(B, H, n)] * (rule != "swa"):
            r, perm = torch.rand(shape, generator=g).to(device).sort(-1)  # the value rule's slots by r; the rank's perm
            width, perm, r = {"swa": (w, None, None), "sa rank": (w, perm, None), "sa value": (w / n, perm, r)}[rule]
            out, lse = _forward(q, k, v, perm, r, width, margin, tiling)
            got = [out, *_backward(do, q, k, v, out, lse, perm, r, width, margin, tiling)]
            errors += [((a.float() - b).abs().nan_to_num(math.inf).max() / b.abs().max().clamp(min=1)).item()
                       for a, b in zip(got, dense(q, k, v, width, perm, r, do))]
    return max(errors)


def where(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU interpreter"


def check_once(device, dtype, D, rule, margin=0.0):
    """Unsupported where the kernel cannot run this case on its GPU, or its self-check, run at the first use, failed;
    else nothing, in a dict lookup. Every message is one line."""
    case = (device, dtype, D, rule)
    if SELF_CHECKS.get(case, math.inf) <= TOLERANCE.get(dtype, 0):
        return
    if D not in HEAD_DIMS or dtype not in SUPPORTED_DTYPES:
        raise Unsupported(f"the Triton kernel runs head dims {', '.join(map(str, HEAD_DIMS))} (a GPT's n_embd / "
                          f"n_head) in float16, bfloat16 and float32, not head dim {D} in {str(dtype)[6:]}")
    tilings(dtype, D, device_target(device))  # Unsupported where the GPU has none
    if SELF_CHECK and case not in SELF_CHECKS:
        with torch.autocast(device.type, enabled=False):
            SELF_CHECKS[case] = self_check(*case, margin=margin)
    if not SELF_CHECKS.get(case, 0.0) <= TOLERANCE[dtype]:  # NaN fails too; SELF_CHECK off: no entry
        raise Unsupported(f"the Triton kernel failed its self-check on {where(device)} {str(dtype)[6:]} for {rule} "
                          f"(head dim {D}): max error {SELF_CHECKS[case]:.1e} against the dense fp32 reference"
                          + "; the interpreter's bf16 tl.dot is wrong (triton-lang/triton#11584): use float32 under "
                          "TRITON_INTERPRET=1" * (device.type != "cuda" and dtype == torch.bfloat16))


if __name__ == "__main__":  # the self-check at other sizes: python kernel.py --check [--B=1 ...], as below
    import itertools
    import os
    import sys
    cuda = torch.cuda.is_available()
    SETTINGS = dict(  # each: its default, how a comma-separated value is read, its test, and the rule a bad one is told
        B=("1", int, lambda x: x >= 1, "a whole number >= 1"), H=("16", int, lambda x: x >= 1, "a whole number >= 1"),
        D=("64", int, HEAD_DIMS.__contains__, f"a head dim with a kernel: {', '.join(map(str, HEAD_DIMS))}"),
        check_T=("1008,4099", int, lambda x: x >= 1, "lengths >= 1, comma separated"),  # 1008 = 16 * 63: training's
        check_windows=("1,64,300", int, lambda x: x >= 1, "windows >= 1, comma separated"),  # specialisation
        dtypes=("bfloat16,float32" if cuda else "float32", lambda x: getattr(torch, x), SUPPORTED_DTYPES.__contains__,
                "float16, bfloat16 or float32, comma separated"))
    args = dict(a[2:].partition("=")[::2] for a in sys.argv[1:])  # --B=2: B, 2
    runs_here = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if "check" not in args or set(args) - {"check", *SETTINGS} or not runs_here:
        raise SystemExit(f"usage: python kernel.py --check [{' '.join(f'--{k}=' for k in SETTINGS)}] on a CUDA GPU, "
                         "or on the CPU with TRITON_INTERPRET=1")
    values = {}
    for name, (default, parse, ok, rule) in SETTINGS.items():
        text = args.get(name, default)
        try:
            values[name] = [parse(x) for x in text.split(",")]
        except (ValueError, AttributeError):
            values[name] = []
        if not values[name] or not all(map(ok, values[name])) or name in ("B", "H", "D") and len(values[name]) > 1:
            raise SystemExit(f"kernel.py: --{name}={text}: use {rule}")
    (B,), (H,), (D,), dtypes = values["B"], values["H"], values["D"], values["dtypes"]
    if not cuda and torch.bfloat16 in dtypes:
        raise SystemExit(f"kernel.py: --dtypes={args['dtypes']}: the interpreter's bf16 tl.dot is wrong "
                         "(triton-lang/triton#11584): use float32 or float16 under TRITON_INTERPRET=1")
    device, failed = torch.device("cuda" if cuda else "cpu"), 0
    __import__("numpy").seterr(all="ignore")  # interpreter: rows past T (0 / 0)
    print(f"B={B} H={H} D={D} on {where(device)}: max |error| of out, dq, dk, dv / max(1, |dense fp32|)")
    for dtype, T, window, rule in itertools.product(dtypes, values["check_T"], values["check_windows"], RULES):
        err, tol = self_check(device, dtype, D, rule, T, window, B, H, seed=T + window), TOLERANCE[dtype]
        failed += not (ok := err <= tol)
        print(f"{rule:>8} {str(dtype)[6:]:>8} T={T:<6} window={window:<5} max err {err:.1e} (tol {tol:.0e}) "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
    if failed:
        raise SystemExit(f"{failed} checks FAILED: report them with this output")
    print("all checks PASS")
