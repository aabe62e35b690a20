"""Support, which a first reading skips past _fwd_inner. Sliding-window attention in Triton, forward and backward:
triton_swa(q, k, v, width, pos, r).

As in Triton's fused-attention tutorial, a forward program streams the key tiles its TILE_M query rows' band reaches,
online softmax in fp32: O(T * w). No repo imports; the rule is attention.py's, and the op checks each variant against
the dense rule at its first use on a device, dtype and head dim (check_once).
"""
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
              getattr(triton.runtime.errors, "PTXASError", triton.runtime.errors.OutOfResources))  # "auto": torch


# Kernels

@triton.jit
def _span(start, TILE_FIXED: tl.constexpr, TILE_LOOP: tl.constexpr, before, after, T, Spans, HAS_R: tl.constexpr):
    """Moving rows x < T meet fixed rows y iff y - before <= x <= y + after: [lo, hi) on the TILE_LOOP grid,
    [mid_lo, mid_hi) in every y's band. With r: the host's span."""
    if HAS_R:
        lo = tl.load(Spans) // TILE_LOOP * TILE_LOOP
        hi = tl.load(Spans + 1)
        mid_lo, mid_hi = hi, hi
    else:
        lo = tl.maximum(start - before, 0) // TILE_LOOP * TILE_LOOP
        hi = tl.minimum(start + TILE_FIXED + after, T)
        mid_lo = tl.minimum(tl.cdiv(tl.maximum(start + TILE_FIXED - 1 - before, 0), TILE_LOOP) * TILE_LOOP, hi)
        mid_hi = tl.maximum(tl.minimum(start + after + 1, T) // TILE_LOOP * TILE_LOOP, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _mask(s, Pos, R, pos_stride_t, qi, kj, left, right, width, T,
          EDGE: tl.constexpr, HAS_POS: tl.constexpr, HAS_R: tl.constexpr):
    if HAS_R:
        r_q = tl.load(R + qi * pos_stride_t, mask=qi < T, other=0.0)
        r_k = tl.load(R + kj * pos_stride_t, mask=kj < T, other=0.0)
        s = tl.where((tl.abs(r_q - r_k) < width) & (kj < T), s, float("-inf"))
    elif EDGE:
        s = tl.where((qi - kj <= left) & (kj - qi <= right) & (kj < T), s, float("-inf"))
    if HAS_POS:
        pos_q = tl.load(Pos + qi * pos_stride_t, mask=qi < T, other=0)
        pos_k = tl.load(Pos + kj * pos_stride_t, mask=kj < T, other=0)
        s = tl.where(pos_k <= pos_q, s, float("-inf"))
    return s


@triton.jit
def _load(ptr, rows, T, D: tl.constexpr, EDGE: tl.constexpr):
    ptrs = ptr + rows[:, None] * D + tl.arange(0, D)[None, :]
    if EDGE:
        return tl.load(ptrs, mask=rows[:, None] < T, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _key_tile(q, offs_m, start_n, K, V, Pos, R, pos_stride_t, left, right, width, T, qk_scale,
               D: tl.constexpr, TILE_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    """k, v at start_n and q's scores in log2 units, -inf where masked: a masked NaN score reaches no sum."""
    offs_n = start_n + tl.arange(0, TILE_N)
    k, v = _load(K, offs_n, T, D, EDGE), _load(V, offs_n, T, D, EDGE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (TILE_M, TILE_N)
    return k, v, _mask(s, Pos, R, pos_stride_t, offs_m[:, None], offs_n[None, :], left, right, width, T,
                       EDGE, HAS_POS, HAS_R)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, R, pos_stride_t, lo, hi, left, right, width, T, qk_scale,
               D: tl.constexpr, TILE_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the key tiles in [lo, hi): acc / l_i is the output so far."""
    for start_n in range(lo, hi, TILE_N):
        k, v, s = _key_tile(q, offs_m, start_n, K, V, Pos, R, pos_stride_t, left, right, width, T, qk_scale,
                             D, TILE_N, EDGE, HAS_POS, HAS_R, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # 1. the new running max of each row
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # only masked keys so far: subtract 0, not -inf
        p = tl.math.exp2(s - m_sub[:, None])  # 2. unnormalised, <= 1; masked keys give 0
        alpha = tl.math.exp2(m_i - m_sub)  # 3. rescale the sums so far, add this tile
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, Pos, R, Spans, pos_stride_b, pos_stride_h, pos_stride_t, span_stride, H, T,
              left, right, width, qk_scale,
              D: tl.constexpr, TILE_M: tl.constexpr, TILE_N: tl.constexpr, HAS_POS: tl.constexpr,
              HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * TILE_M
    bh = tl.program_id(1)
    off = bh.to(tl.int64) * T * D
    Q, K, V, O, LSE = Q + off, K + off, V + off, O + off, LSE + bh.to(tl.int64) * T
    bh_off = (bh // H) * pos_stride_b + (bh % H) * pos_stride_h  # strides maybe 0
    Pos, R = Pos + bh_off, R + bh_off
    offs_m = start_m + tl.arange(0, TILE_M)
    q = _load(Q, offs_m, T, D, True)
    acc = tl.zeros([TILE_M, D], dtype=tl.float32)
    l_i, m_i = tl.zeros([TILE_M], dtype=tl.float32), tl.zeros([TILE_M], dtype=tl.float32) + float("-inf")
    Spans += bh * span_stride + tl.program_id(0) * 2
    lo, mid_lo, mid_hi, hi = _span(start_m, TILE_M, TILE_N, left, right, T, Spans, HAS_R)
    for region in tl.static_range(3):  # left edge, interior (no band mask or bounds checks), right edge
        a = lo if region == 0 else mid_lo if region == 1 else mid_hi
        b = mid_lo if region == 0 else mid_hi if region == 1 else hi
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, R, pos_stride_t, a, b, left, right, width,
                                   T, qk_scale, D, TILE_N, region != 1, HAS_POS, HAS_R, PRECISION)
    tl.store(LSE + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)
    tl.store(O + offs_m[:, None] * D + tl.arange(0, D)[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=offs_m[:, None] < T)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, RowDot, Pos, R, pos_stride_t, lo, hi, left, right, width, T,
                    qk_scale, D: tl.constexpr, TILE_M: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
                    HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    """Fixed key tile, moving query tiles; keys along rows."""
    for start_m in range(lo, hi, TILE_M):
        offs_m = start_m + tl.arange(0, TILE_M)
        q, do = _load(Q, offs_m, T, D, EDGE), _load(DO, offs_m, T, D, EDGE)
        lse = tl.load(LSE + offs_m, mask=offs_m < T, other=0.0)
        rowdot = tl.load(RowDot + offs_m, mask=offs_m < T, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (TILE_FIXED, TILE_M)
        sT = _mask(sT, Pos, R, pos_stride_t, offs_m[None, :], offs_n[:, None], left, right, width, T,
                   EDGE, HAS_POS, HAS_R)
        pT = tl.math.exp2(tl.minimum(sT - lse[None, :], 0.0))  # <= 1: at |s| ~ 1e9, s may exceed lse
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - rowdot[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, rowdot, offs_m, K, V, Pos, R, pos_stride_t, lo, hi, left, right, width, T,
                  qk_scale, D: tl.constexpr, TILE_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
                  HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(lo, hi, TILE_N):
        k, v, s = _key_tile(q, offs_m, start_n, K, V, Pos, R, pos_stride_t, left, right, width, T, qk_scale,
                             D, TILE_N, EDGE, HAS_POS, HAS_R, PRECISION)
        p = tl.math.exp2(tl.minimum(s - lse[:, None], 0.0))
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - rowdot[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, LSE, RowDot, Pos, R, Spans, pos_stride_b, pos_stride_h, pos_stride_t,
              span_stride, H, T, left, right, width, qk_scale, sm_scale,
              D: tl.constexpr, TILE_FIXED: tl.constexpr, TILE_LOOP: tl.constexpr, HAS_POS: tl.constexpr,
              HAS_R: tl.constexpr, PRECISION: tl.constexpr):
    """Program (i, bh): dK, dV of key tile i, then dQ of query tile i."""
    start = tl.program_id(0) * TILE_FIXED
    bh = tl.program_id(1)
    off = bh.to(tl.int64) * T * D
    Q, K, V, DO, DQ, DK, DV = Q + off, K + off, V + off, DO + off, DQ + off, DK + off, DV + off
    LSE, RowDot = LSE + bh.to(tl.int64) * T, RowDot + bh.to(tl.int64) * T
    bh_off = (bh // H) * pos_stride_b + (bh % H) * pos_stride_h
    Pos, R = Pos + bh_off, R + bh_off
    Spans += bh * span_stride + tl.program_id(0) * 2
    rows = start + tl.arange(0, TILE_FIXED)
    at = rows[:, None] * D + tl.arange(0, D)[None, :]  # (TILE_FIXED, D)

    # dK, dV: query i reaches key j iff j - right <= i <= j + left
    k, v = _load(K, rows, T, D, True), _load(V, rows, T, D, True)
    dk, dv = tl.zeros([TILE_FIXED, D], dtype=tl.float32), tl.zeros([TILE_FIXED, D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _span(start, TILE_FIXED, TILE_LOOP, right, left, T, Spans, HAS_R)  # r: symmetric
    for region in tl.static_range(3):
        a = lo if region == 0 else mid_lo if region == 1 else mid_hi
        b = mid_lo if region == 0 else mid_hi if region == 1 else hi
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, RowDot, Pos, R, pos_stride_t, a, b, left, right,
                                 width, T, qk_scale, D, TILE_LOOP, region != 1, HAS_POS, HAS_R, PRECISION)
    tl.store(DK + at, (dk * sm_scale).to(DK.dtype.element_ty), mask=rows[:, None] < T)
    tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=rows[:, None] < T)
    q, do = _load(Q, rows, T, D, True), _load(DO, rows, T, D, True)
    lse, rowdot = tl.load(LSE + rows, mask=rows < T, other=0.0), tl.load(RowDot + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([TILE_FIXED, D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _span(start, TILE_FIXED, TILE_LOOP, left, right, T, Spans, HAS_R)
    for region in tl.static_range(3):
        a = lo if region == 0 else mid_lo if region == 1 else mid_hi
        b = mid_lo if region == 0 else mid_hi if region == 1 else hi
        dq = _bwd_dq_inner(dq, q, do, lse, rowdot, rows, K, V, Pos, R, pos_stride_t, a, b, left, right, width,
                           T, qk_scale, D, TILE_LOOP, region != 1, HAS_POS, HAS_R, PRECISION)
    tl.store(DQ + at, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < T)


# Host

class Target(NamedTuple):
    backend: str  # "cuda" or "hip" (ROCm)
    arch: object  # 80 for sm_80, or "gfx942"
    shared: int  # bytes


class Tiling(NamedTuple):
    tile_m: int  # forward: query rows per program
    tile_n: int  # forward: keys per step
    tile_fixed: int  # backward: rows per program (keys, queries)
    tile_loop: int  # backward: rows per step
    num_warps: int
    num_stages: int
    precision: str  # tl.dot input_precision for fp32
    shared_kb: int  # KB of shared memory asked of the GPU: the kernels' measured use and a reserve


INTERPRETER = Target("cuda", 80, 163 * 1024)


def device_target(device):
    return _cuda_target(device) if device.type == "cuda" else INTERPRETER


@functools.lru_cache  # Triton's device query took 0.9 ms a call on an H200
def _cuda_target(device):
    with torch.cuda.device(device):
        driver = triton.runtime.driver.active
        target, props = driver.get_current_target(), driver.utils.get_device_properties(torch.cuda.current_device())
    return Target(target.backend, target.arch, props["max_shared_mem"])


def choose_tiling(dtype, D, target):
    """The largest tiles found to compile without fp16/bf16 spills on sm_80 to sm_90, within shared_kb."""
    if target.backend == "cuda" and target.arch < 80:
        raise Unsupported(f"sm_{target.arch}: Triton {triton.__version__} has no tensor-core dot below sm_80: the "
                          "kernel would spill registers")
    amd, small = target.backend == "hip", D <= 64  # gfx942: 64 KB LDS, 64-thread warps
    if dtype == torch.float32:  # 2x bytes, tf32x3's 3 passes: small tiles
        config = Tiling(*(32, 32, 32, 32) if small else (16, 32, 16, 32), 4, 2, "ieee" if amd else "tf32x3",
                        64 if small else 80)
    else:
        config = Tiling(*(128, 64, 128, 32) if small else (128, 32, 64, 32), 8, 3, None, 72 if small else 96)
    if amd:  # D = 128: 32 moving rows spill
        config = config._replace(tile_loop=config.tile_loop if small else 16, num_warps=4, num_stages=2, shared_kb=64)
    if target.shared < config.shared_kb * 1024:
        raise Unsupported(f"the kernel for {str(dtype)[6:]} at head dim {D} asks for {config.shared_kb} KB of shared "
                          f"memory, the GPU has {target.shared // 1024} KB")
    return config


# copies of tiled.py's (test_kernel.py holds them equal)
def band_edges(window, T, two_sided):
    left = min(int(window), T) - 1
    return left, left if two_sided else 0


def value_spans(r, width, margin, tile):
    first = torch.arange(0, r.shape[-1], tile, device=r.device)  # (ntiles,)
    last = (first + tile).clamp(max=r.shape[-1]) - 1
    hi = torch.searchsorted(r, r[:, last] + width + margin).maximum(last + 1)  # (n, ntiles), own slots in
    return torch.searchsorted(r, r[:, first] - width - margin), hi


def _launch_args(q, pos, r, width, margin, tiling, tile):
    """The kernels' arguments Pos .. width, and options."""
    B, H, T, D = q.shape
    Pos = q if pos is None else pos.expand(B, H, T)  # no copy; q: a dummy
    R = q if r is None else r.expand(B, H, T)
    if r is None:  # the band [i - left, i + right]
        (left, right), width, spans, span_stride = band_edges(width, T, pos is not None), 0.0, q, 0
    else:  # |r_i - r_j| < width over each tile's span
        rows = R.reshape(B * H, T) if r.dim() > 1 else r[None]  # (n, T), n = 1 or BH
        spans = torch.stack(value_spans(rows, width, margin, tile), -1).to(torch.int32)  # (n, ntiles, 2)
        left, right, span_stride = 0, 0, 0 if len(rows) == 1 else spans[0].numel()
    options = dict(D=D, HAS_POS=pos is not None, HAS_R=r is not None, PRECISION=tiling.precision,
                   num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return (Pos, R, spans, *(Pos.stride() if pos is not None else (0, 0, 0)), span_stride, H, T, left, right,
            width), options


@torch.library.custom_op("sa::triton_swa", mutates_args=())  # opaque to torch.compile
def _forward(q: Tensor, k: Tensor, v: Tensor, pos: Optional[Tensor], r: Optional[Tensor], width: float,
             margin: float, check: bool) -> tuple[Tensor, Tensor]:
    """out (B, H, T, D) and each row's log2-sum-exp2 (B, H, T) fp32; check: check_once first (False in
    self_check's own calls)."""
    (B, H, T, D), target = q.shape, device_target(q.device)
    if check:
        check_once(q.device, q.dtype, D, VARIANTS[(pos is not None) + (r is not None)], margin)
    tiling = choose_tiling(q.dtype, D, target)
    q, k, v = map(Tensor.contiguous, (q, k, v))
    o, lse = torch.empty_like(q), q.new_empty((B, H, T), dtype=torch.float32)
    with torch.cuda.device(q.device if q.is_cuda else -1):  # q's GPU, not the current one
        args, options = _launch_args(q, pos, r, width, margin, tiling, tiling.tile_m)
        _attn_fwd[(triton.cdiv(T, tiling.tile_m), B * H)](
            q, k, v, o, lse, *args, LOG2E / math.sqrt(D), TILE_M=tiling.tile_m, TILE_N=tiling.tile_n, **options)
        if q.is_cuda and torch.is_grad_enabled():  # compile the backward now: "auto" can fall back
            bwd = _attn_bwd.warmup(q, k, v, o, q, k, v, lse, lse, *args, 0.0, 0.0, grid=(1,),
                                   TILE_FIXED=tiling.tile_fixed, TILE_LOOP=tiling.tile_loop, **options)
            if bwd is not None and bwd.metadata.shared > target.shared:  # None: a compile hook took it
                raise Unsupported(f"the backward kernel needs {bwd.metadata.shared // 1024} KB of shared memory, "
                                  f"the GPU has {target.shared // 1024} KB")
    return o, lse


@torch.library.custom_op("sa::triton_swa_backward", mutates_args=())
def _backward(dout: Tensor, out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Optional[Tensor],
              r: Optional[Tensor], width: float, margin: float, check: bool) -> tuple[Tensor, Tensor, Tensor]:
    B, H, T, D = q.shape
    tiling = choose_tiling(q.dtype, D, device_target(q.device))
    q, k, v, dout = map(Tensor.contiguous, (q, k, v, dout))
    with torch.cuda.device(q.device if q.is_cuda else -1):
        args, options = _launch_args(q, pos, r, width, margin, tiling, tiling.tile_fixed)
        rowdot = (out.float() * dout.float()).sum(-1)  # (B, H, T)
        dq, dk, dv = map(torch.empty_like, (q, k, v))
        _attn_bwd[(triton.cdiv(T, tiling.tile_fixed), B * H)](
            q, k, v, dout, dq, dk, dv, lse, rowdot, *args, LOG2E / math.sqrt(D), 1 / math.sqrt(D),
            TILE_FIXED=tiling.tile_fixed, TILE_LOOP=tiling.tile_loop, **options)
    return dq, dk, dv


def _save(ctx, inputs, output):
    ctx.save_for_backward(*output, *inputs[:5])  # _backward's out .. r
    ctx.scalars = inputs[5:]


_forward.register_fake(lambda q, *_: (q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)))
_backward.register_fake(lambda dout, out, lse, *qkv: tuple(t.new_empty(t.shape) for t in qkv[:3]))
_forward.register_autograd(lambda ctx, dout, _: (*_backward(dout, *ctx.saved_tensors, *ctx.scalars),
                                                 *[None] * (2 + len(ctx.scalars))), setup_context=_save)


def triton_swa(q, k, v, width, pos=None, r=None, margin=0.0):
    """(B, H, T, D) -> (B, H, T, D): key j is visible to query i iff |i - j| < width (an int >= 1), with r (fp32,
    pos's shape, ascending) iff |r[i] - r[j]| < width, and pos[j] <= pos[i]; spans reach `margin` further."""
    B, H, T, D = q.shape
    if D not in HEAD_DIMS or q.dtype not in SUPPORTED_DTYPES:
        raise Unsupported(f"triton_swa supports head dims {HEAD_DIMS} in {SUPPORTED_DTYPES}, got {D} in {q.dtype}; "
                          "pad it or use the torch path")
    if any((t.shape, t.dtype, t.device) != (q.shape, q.dtype, q.device) for t in (k, v)):
        raise ValueError(f"q, k, v must share one shape, device and dtype, got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in (q, k, v)]}")
    if pos is not None and not (pos.dtype == torch.long and pos.device == q.device and 1 <= pos.dim() <= 3
                                and all(a in (1, b) for a, b in zip(reversed(pos.shape), (T, H, B)))):
        raise ValueError(f"pos must be a LongTensor on {q.device} broadcastable to (B, H, T)=({B}, {H}, {T}), "
                         f"got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
    if r is not None and (pos is None or (r.dtype, r.shape, r.device) != (torch.float32, pos.shape, q.device)
                          or not width > 0 or not (torch.compiler.is_compiling() or bool((r.diff() >= 0).all()))):
        raise ValueError(f"r must be fp32 with pos's shape, ascending along T, and the width > 0; got {r.dtype} "
                         f"{tuple(r.shape)}, pos {None if pos is None else tuple(pos.shape)}, width {width!r}")
    pos, r = (pos, r) if r is None else (pos.contiguous(), r.contiguous())  # one set of strides
    return _forward(q, k, v, pos, r, width, margin, True)[0]


# The self-check

VARIANTS = ("swa", "sa rank", "sa value")  # no pos (causal SWA); pos; pos and r
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 5e-2, torch.float32: 1e-3}
SELF_CHECKS = {}  # (device, dtype, D, variant) -> max error


def dense(q, k, v, width, pos=None, r=None, dout=None):
    """triton_swa's rule, dense, fp32: out, and with dout dq, dk, dv (no autograd in an op)."""
    idx = torch.arange(q.shape[2], device=q.device)
    slot, pos = idx if r is None else r, idx if pos is None else pos
    mask = ((slot[..., :, None] - slot[..., None, :]).abs() < width) & (pos[..., None, :] <= pos[..., :, None])
    q, k, v, scale = q.float(), k.float(), v.float(), q.shape[-1] ** -0.5
    p = torch.softmax((q @ k.mT * scale).masked_fill(~mask, float("-inf")), -1)  # (B, H, T, T)
    out = p @ v  # (B, H, T, D)
    if dout is None:
        return out
    do = dout.float()
    ds = p * (do @ v.mT - (do * out).sum(-1, keepdim=True))  # dloss/dscores
    return out, ds @ k * scale, ds.mT @ q * scale, p.mT @ do


def self_check(device, dtype, D, variant, T=300, window=100, B=1, H=2, margin=0.0, seed=0):
    """Max |error| of the kernel's out, dq, dk, dv / max(1, |dense's|) on random input; NaN counts as inf."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(4))
    perm = (r := torch.rand(T, generator=g).to(device)).argsort()  # r[perm]: value-rule slots
    width, pos, r = {"swa": (window, None, None), "sa rank": (window, perm, None),
                     "sa value": (window / T, perm, r[perm])}[variant]
    out, lse = _forward(q, k, v, pos, r, width, margin, False)
    got = [out, *_backward(do, out, lse, q, k, v, pos, r, width, margin, False)]
    return max(((a.float() - b).abs().nan_to_num(math.inf).max() / b.abs().max().clamp(min=1)).item()
               for a, b in zip(got, dense(q, k, v, width, pos, r, do)))


def where(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU interpreter"


def check_once(device, dtype, D, variant, margin=0.0):
    """self_check at a key's first use (in _forward, the op compiled graphs call); failed: Unsupported from then on."""
    key = (device, dtype, D, variant)
    if SELF_CHECK and key not in SELF_CHECKS:
        with torch.autocast(device.type, enabled=False):
            SELF_CHECKS[key] = self_check(*key, margin=margin)
    if not SELF_CHECKS.get(key, 0.0) <= TOLERANCE[dtype]:  # NaN fails too; SELF_CHECK off: no entry
        raise Unsupported(f"the Triton kernel failed its self-check on {where(device)} {str(dtype)[6:]} for {variant} "
                          f"(head dim {D}): max error {SELF_CHECKS[key]:.1e} against the dense fp32 reference")


if __name__ == "__main__":
    import itertools
    import os
    import sys
    B, H, D, check_T, check_windows = 1, 16, 64, "1000,4099", "1,64,300"  # lengths no multiple of any tile
    args, cuda = dict(a[2:].partition("=")[::2] for a in sys.argv[1:]), torch.cuda.is_available()  # --B=2: B, 2
    if "check" not in args or set(args) - {"check", *"BHD", "check_T", "check_windows"} or not (
            cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("usage: python kernel.py --check [--B= --H= --D= --check_T= --check_windows=] on a CUDA GPU, "
                         "or on the CPU with TRITON_INTERPRET=1")
    globals().update({k: int(v) if k in "BHD" else v for k, v in args.items()})
    device, failed = torch.device("cuda" if cuda else "cpu"), 0
    __import__("numpy").seterr(all="ignore")  # interpreter: rows past T (0 / 0)
    print(f"B={B} H={H} D={D} on {where(device)}: max |error| of out, dq, dk, dv / max(1, |dense fp32|)")
    dtypes = (torch.bfloat16, torch.float32)[not cuda:]  # interpreter: bf16 tl.dot wrong (triton-lang/triton#11584)
    Ts, windows = (map(int, x.split(",")) for x in (check_T, check_windows))
    for dtype, T, window, variant in itertools.product(dtypes, Ts, windows, VARIANTS):
        err, tol = self_check(device, dtype, D, variant, T, window, B, H, seed=T + window), TOLERANCE[dtype]
        failed += not (ok := err <= tol)
        print(f"{variant:>8} {str(dtype)[6:]:>8} T={T:<6} window={window:<5} max err {err:.1e} (tol {tol:.0e}) "
              f"{'PASS' if ok else 'FAIL'}")
    if failed:
        raise SystemExit(f"{failed} checks FAILED: report them with this output")
    print("all checks PASS")
