"""
Sliding-window attention in Triton, forward and backward: triton_swa(q, k, v, window, pos, val).

The rule is stated once, in attention.py's docstring (sliding_window_attention with pos);
this file only makes it fast. It imports nothing
from this repo. Stochastic attention reuses it: attention.stochastic_attention gathers
q, k, v by perm, calls triton_swa(..., pos=perm) and scatters the output back; SA's value
rule (attention.stochastic_value_attention) sorts by r and calls triton_swa(..., width,
pos=perm, val=sorted r), where each block's key span comes from the host (_val_spans).

How it works (shaped like Triton's fused-attention tutorial, 06-fused-attention.py):
- Forward: program (i, b*h) owns BLOCK_M query rows and streams the key blocks that its
  band reaches, keeping an online softmax (running max m_i, running sum l_i, output
  accumulator acc, all fp32). Work and memory are O(T * window), never T x T.
- Each loop runs three times: the left edge (key blocks that cross the band's lower
  boundary), the interior (blocks inside the band for every row of the program: no band
  mask, only the pos rule) and the right edge (the upper boundary and the end of the
  sequence). Only the edges pay for the band mask and for bounds checks. The value rule
  has no interior: it runs one loop over its span, masking |val_i - val_j| < width.
- Masked scores are -inf, so no visible score can ever lose to a masked one, whatever
  the scale of q and k. Every real query sees itself, so no real row is fully masked.
- Backward: program (i, b*h) computes dK, dV for key block i (moving over query blocks)
  and then dQ for query block i (moving over key blocks), recomputing the probabilities
  from the forward's log-sum-exp. They are clamped to <= 1: at huge scores (|q.k| ~ 1e9)
  the recomputed score can differ from the forward's by a few fp32 ulps, and without the
  clamp exp2 of that difference overflows fp16 gradients.
- Configuration (choose_config): block sizes, warps and pipeline stages come from the
  dtype, the head dim and the device (architecture, shared memory). fp16/bf16 use 128-row
  blocks (64 in the D = 128 backward) and 8 warps; fp32 uses 32-row blocks (16 at D = 128) and tf32x3, three TF32
  passes that are about fp32-exact (AMD's backend rejects tf32x3: "ieee" there). Below
  sm_80, and where the device lacks the shared memory, choose_config raises, and
  attention.py's BACKEND="auto" falls back to the torch path with a one-line warning.

Compiled ahead of time with Triton 3.9's bundled ptxas, no GPU needed (the whole table:
python -m pytest -s --slow test_kernel.py -k every_target), with the configurations above:
  - fp16/bf16, D = 64 and 128, forward and backward, both rules (the value rule is the
    HAS_VAL variant): no register spills on sm_80, sm_86, sm_89, sm_90 and gfx942. Shared
    memory: at most 69 KB on sm_80/86/89, 81 KB on sm_90 (D = 128 backward), 32 KB on
    gfx942; so everything fits the 99 KB of sm_86/sm_89.
  - fp32 with tf32x3: the forward does not spill; the backward spills 4-92 bytes at D = 64
    and 248-448 bytes at D = 128 (value rule: 0-56 and 64-208). (With 64-row blocks, tf32x3 spilled about 29 KB in the D = 64
    forward, and "ieee" 0.4-44 KB.) fp32 is the slow path either way: train in bf16.
  - sm_75 (T4, RTX 20xx): Triton 3.9 compiles tl.dot there to FMAs, not tensor cores, and the
    fp16 backward spilled 3.6-44 KB at every block size tried (16 to 64 rows); so the kernel
    declines and the torch path runs.
Timings on a GPU have not been measured by this project yet.

Runs on the CPU under TRITON_INTERPRET=1 (that is how test_kernel.py checks it).
On a GPU: python kernel.py --check   (correctness against the torch path and FlexAttention,
then the speed table against FlexAttention and SDPA)
"""
import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

HEAD_DIMS = (16, 32, 64, 128)  # power-of-two head dims the kernels compile for
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634     # the kernels use exp2; scores are pre-scaled by log2(e)
# errors that mean "the kernel cannot run here" (attention.py's "auto" then takes the torch path): any other raises
CANNOT_RUN = (ValueError, triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources,
              getattr(triton.runtime.errors, "PTXASError", triton.runtime.errors.OutOfResources))


# -----------------------------------------------------------------------------
# Kernels

@triton.jit
def _span(start, FIXED: tl.constexpr, MOVE: tl.constexpr, before, after, T):
    """Moving rows x meet fixed rows y iff y - before <= x <= y + after and x < T.
    Returns [lo, hi) on the MOVE grid, split at mid_lo <= mid_hi: the blocks in
    [mid_lo, mid_hi) are fully inside the band for every row of the fixed block."""
    lo = tl.maximum(start - before, 0) // MOVE * MOVE
    hi = tl.minimum(start + FIXED + after, T)
    mid_lo = tl.minimum(tl.cdiv(tl.maximum(start + FIXED - 1 - before, 0), MOVE) * MOVE, hi)
    mid_hi = tl.maximum(tl.minimum(start + after + 1, T) // MOVE * MOVE, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _mask(s, Pos, Val, pos_stride_t, qi, kj, left, right, width, T,
          EDGE: tl.constexpr, HAS_POS: tl.constexpr, HAS_VAL: tl.constexpr):
    """s where key kj is visible to query qi (qi, kj broadcast to s's shape), -inf elsewhere.
    Inside the band (EDGE False) only the position rule is left to check. Query rows past T
    need no mask: they load zeros (q, dO, delta), add nothing to dK, dV and are never stored.
    With val, the band is |val[qi] - val[kj]| < width, and every block is an edge block."""
    if HAS_VAL:
        val_q = tl.load(Val + qi * pos_stride_t, mask=qi < T, other=0.0)
        val_k = tl.load(Val + kj * pos_stride_t, mask=kj < T, other=0.0)
        s = tl.where((tl.abs(val_q - val_k) < width) & (kj < T), s, float("-inf"))
    elif EDGE:
        s = tl.where((qi - kj <= left) & (kj - qi <= right) & (kj < T), s, float("-inf"))
    if HAS_POS:
        pos_q = tl.load(Pos + qi * pos_stride_t, mask=qi < T, other=0)
        pos_k = tl.load(Pos + kj * pos_stride_t, mask=kj < T, other=0)
        s = tl.where(pos_k <= pos_q, s, float("-inf"))
    return s


@triton.jit
def _load(ptr, rows, T, D: tl.constexpr, EDGE: tl.constexpr):
    """(len(rows), D) tile of a contiguous (T, D) matrix; only edge blocks can run past T."""
    ptrs = ptr + rows[:, None] * D + tl.arange(0, D)[None, :]
    if EDGE:
        return tl.load(ptrs, mask=rows[:, None] < T, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _key_block(q, offs_m, start_n, K, V, Pos, Val, pos_stride_t, left, right, width, T, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_VAL: tl.constexpr, PRECISION: tl.constexpr):
    """k, v of the key block at start_n and the masked scores of q against it, in log2 units."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(K, offs_n, T, D, EDGE)
    v = _load(V, offs_n, T, D, EDGE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
    return k, v, _mask(s, Pos, Val, pos_stride_t, offs_m[:, None], offs_n[None, :], left, right, width, T,
                       EDGE, HAS_POS, HAS_VAL)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, Val, pos_stride_t, lo, hi, left, right, width, T, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_VAL: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the key blocks in [lo, hi): acc / l_i is the attention output so far."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v, s = _key_block(q, offs_m, start_n, K, V, Pos, Val, pos_stride_t, left, right, width, T, qk_scale,
                             D, BLOCK_N, EDGE, HAS_POS, HAS_VAL, PRECISION)
        # 1. the new running max of each row's scores
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has met only masked keys so far keeps max -inf; subtract 0 there, not -inf (NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        # 2. unnormalised probabilities against the new max: <= 1, masked keys give exactly 0
        p = tl.math.exp2(s - m_sub[:, None])
        # 3. rescale what was summed under the old max, then add this block
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, Pos, Val, Spans, pos_stride_b, pos_stride_h, pos_stride_t, span_stride, H, T,
              left, right, width, qk_scale,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr,
              HAS_VAL: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    off = bh.to(tl.int64) * T * D                     # (B, H, T, D) contiguous
    Q, K, V, O, LSE = Q + off, K + off, V + off, O + off, LSE + bh.to(tl.int64) * T
    Pos += (bh // H) * pos_stride_b + (bh % H) * pos_stride_h  # pos is expanded to (B, H, T), maybe with 0 strides
    Val += (bh // H) * pos_stride_b + (bh % H) * pos_stride_h  # val has pos's shape
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(Q, offs_m, T, D, True)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
    if HAS_VAL:  # this block's key span, from the host (_val_spans): every block an edge block
        Spans += bh * span_stride + tl.program_id(0) * 2
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, Val, pos_stride_t,
                                   tl.load(Spans) // BLOCK_N * BLOCK_N, tl.load(Spans + 1), left, right, width, T,
                                   qk_scale, D, BLOCK_N, True, HAS_POS, HAS_VAL, PRECISION)
    else:
        lo, mid_lo, mid_hi, hi = _span(start_m, BLOCK_M, BLOCK_N, left, right, T)
        # left edge
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, Val, pos_stride_t, lo, mid_lo, left, right,
                                   width, T, qk_scale, D, BLOCK_N, True, HAS_POS, HAS_VAL, PRECISION)
        # interior
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, Val, pos_stride_t, mid_lo, mid_hi, left, right,
                                   width, T, qk_scale, D, BLOCK_N, False, HAS_POS, HAS_VAL, PRECISION)
        # right edge
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, Pos, Val, pos_stride_t, mid_hi, hi, left, right,
                                   width, T, qk_scale, D, BLOCK_N, True, HAS_POS, HAS_VAL, PRECISION)
    tl.store(LSE + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)  # log2-sum-exp2, for the backward
    tl.store(O + offs_m[:, None] * D + tl.arange(0, D)[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=offs_m[:, None] < T)


@triton.jit
def _attn_bwd_preprocess(O, DO, Delta, T, D: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    o = _load(O + bh * T * D, offs_m, T, D, True)
    do = _load(DO + bh * T * D, offs_m, T, D, True)
    tl.store(Delta + bh * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < T)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, Delta, Pos, Val, pos_stride_t, lo, hi, left, right, width, T,
                    qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
                    HAS_VAL: tl.constexpr, PRECISION: tl.constexpr):
    """Fixed key block (k, v), moving query blocks; everything transposed: keys along rows."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(Q, offs_m, T, D, EDGE)
        do = _load(DO, offs_m, T, D, EDGE)
        lse = tl.load(LSE + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(Delta + offs_m, mask=offs_m < T, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        sT = _mask(sT, Pos, Val, pos_stride_t, offs_m[None, :], offs_n[:, None], left, right, width, T,
                   EDGE, HAS_POS, HAS_VAL)
        pT = tl.math.exp2(tl.minimum(sT - lse[None, :], 0.0))           # probabilities, clamped to <= 1
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, offs_m, K, V, Pos, Val, pos_stride_t, lo, hi, left, right, width, T,
                  qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr,
                  HAS_VAL: tl.constexpr, PRECISION: tl.constexpr):
    """Fixed query block, moving key blocks."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v, s = _key_block(q, offs_m, start_n, K, V, Pos, Val, pos_stride_t, left, right, width, T, qk_scale,
                             D, BLOCK_N, EDGE, HAS_POS, HAS_VAL, PRECISION)
        p = tl.math.exp2(tl.minimum(s - lse[:, None], 0.0))               # probabilities, clamped to <= 1
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, LSE, Delta, Pos, Val, Spans, pos_stride_b, pos_stride_h, pos_stride_t,
              span_stride, H, T, left, right, width, qk_scale, sm_scale,
              D: tl.constexpr, FIXED: tl.constexpr, MOVE: tl.constexpr, HAS_POS: tl.constexpr,
              HAS_VAL: tl.constexpr, PRECISION: tl.constexpr):
    """Program (i, bh) computes dK, dV for key block i and dQ for query block i."""
    start = tl.program_id(0) * FIXED
    bh = tl.program_id(1)
    off = bh.to(tl.int64) * T * D
    Q, K, V, DO, DQ, DK, DV = Q + off, K + off, V + off, DO + off, DQ + off, DK + off, DV + off
    LSE, Delta = LSE + bh.to(tl.int64) * T, Delta + bh.to(tl.int64) * T
    Pos += (bh // H) * pos_stride_b + (bh % H) * pos_stride_h
    Val += (bh // H) * pos_stride_b + (bh % H) * pos_stride_h
    Spans += bh * span_stride + tl.program_id(0) * 2  # with val: the block's span, the same for dK, dV and dQ
    rows = start + tl.arange(0, FIXED)
    tile = rows[:, None] * D + tl.arange(0, D)[None, :]   # this block's (FIXED, D) tile

    # dK, dV: query i reaches key j iff j - right <= i <= j + left, so the span's reach is mirrored
    k = _load(K, rows, T, D, True)
    v = _load(V, rows, T, D, True)
    dk = tl.zeros([FIXED, D], dtype=tl.float32)
    dv = tl.zeros([FIXED, D], dtype=tl.float32)
    if HAS_VAL:  # |val_i - val_j| < width is symmetric: the queries that see this block are its span
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, Pos, Val, pos_stride_t,
                                 tl.load(Spans) // MOVE * MOVE, tl.load(Spans + 1), left, right, width, T,
                                 qk_scale, D, MOVE, True, HAS_POS, HAS_VAL, PRECISION)
    else:
        lo, mid_lo, mid_hi, hi = _span(start, FIXED, MOVE, right, left, T)
        # left edge
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, Pos, Val, pos_stride_t, lo, mid_lo, left,
                                 right, width, T, qk_scale, D, MOVE, True, HAS_POS, HAS_VAL, PRECISION)
        # interior
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, Pos, Val, pos_stride_t, mid_lo, mid_hi, left,
                                 right, width, T, qk_scale, D, MOVE, False, HAS_POS, HAS_VAL, PRECISION)
        # right edge
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, Pos, Val, pos_stride_t, mid_hi, hi, left,
                                 right, width, T, qk_scale, D, MOVE, True, HAS_POS, HAS_VAL, PRECISION)
    tl.store(DK + tile, (dk * sm_scale).to(DK.dtype.element_ty), mask=rows[:, None] < T)
    tl.store(DV + tile, dv.to(DV.dtype.element_ty), mask=rows[:, None] < T)

    # dQ
    q = _load(Q, rows, T, D, True)
    do = _load(DO, rows, T, D, True)
    lse = tl.load(LSE + rows, mask=rows < T, other=0.0)
    delta = tl.load(Delta + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([FIXED, D], dtype=tl.float32)
    if HAS_VAL:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, Pos, Val, pos_stride_t, tl.load(Spans) // MOVE * MOVE,
                           tl.load(Spans + 1), left, right, width, T, qk_scale, D, MOVE, True, HAS_POS, HAS_VAL,
                           PRECISION)
    else:
        lo, mid_lo, mid_hi, hi = _span(start, FIXED, MOVE, left, right, T)
        # left edge
        dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, Pos, Val, pos_stride_t, lo, mid_lo, left, right, width,
                           T, qk_scale, D, MOVE, True, HAS_POS, HAS_VAL, PRECISION)
        # interior
        dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, Pos, Val, pos_stride_t, mid_lo, mid_hi, left, right,
                           width, T, qk_scale, D, MOVE, False, HAS_POS, HAS_VAL, PRECISION)
        # right edge
        dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, Pos, Val, pos_stride_t, mid_hi, hi, left, right, width,
                           T, qk_scale, D, MOVE, True, HAS_POS, HAS_VAL, PRECISION)
    tl.store(DQ + tile, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < T)


# -----------------------------------------------------------------------------
# Configuration: from the device and the dtype

class Target(NamedTuple):
    backend: str    # "cuda" or "hip" (ROCm; there q.is_cuda is True too)
    arch: object    # compute capability as an int (80 = sm_80) or an AMD arch name ("gfx942")
    shared: int     # shared memory a block may use, in bytes


class Config(NamedTuple):
    block_m: int      # forward: query rows per program
    block_n: int      # forward: keys per inner step
    fixed: int        # backward: rows a program owns (keys for dK/dV, queries for dQ)
    move: int         # backward: rows per inner step
    num_warps: int
    num_stages: int   # software pipelining depth of the inner loops' loads
    precision: str    # tl.dot input_precision of fp32 dots; None (the default) for fp16/bf16
    shared_kb: int    # shared memory the kernels need at most, as compiled for the targets above


INTERPRETER = Target("cuda", 80, 163 * 1024)  # what the CPU interpreter pretends to be


def device_target(device):
    """The Target of a CUDA or ROCm device, as Triton sees it."""
    if device.type != "cuda":
        return INTERPRETER
    with torch.cuda.device(device):
        driver = triton.runtime.driver.active
        target = driver.get_current_target()
        shared = driver.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]
    return Target(target.backend, target.arch, shared)


def choose_config(dtype, D, target):
    """Block sizes, warps, stages and fp32 dot precision for this dtype, head dim and device.
    The sizes are the largest found to compile without register spills for fp16/bf16 on sm_80,
    sm_86, sm_89 and sm_90, and shared_kb is the most they need there (test_kernel.py compiles
    them again and asserts both). Raises ValueError where the kernel should not run."""
    if target.backend == "cuda" and target.arch < 80:
        raise ValueError(f"sm_{target.arch}: Triton {triton.__version__} has no tensor-core dot below sm_80, "
                         "so the kernel would spill registers and lose to the torch path")
    amd = target.backend == "hip"  # gfx942: 64 KB of LDS, 64-thread warps: fewer warps and stages
    if dtype == torch.float32:
        # fp32 tiles hold twice the bytes and tf32x3's three passes three times the operands: small
        # blocks. tf32x3 (about fp32-exact) where TF32 exists; AMD's backend rejects it: "ieee" there.
        config = Config(32 if D <= 64 else 16, 32, 32 if D <= 64 else 16, 32, num_warps=4, num_stages=2,
                        precision="ieee" if amd else "tf32x3", shared_kb=64 if D <= 64 else 80)
    elif D <= 64:
        config = Config(128, 64, 128, 32, num_warps=8, num_stages=3, precision=None, shared_kb=72)
    else:
        config = Config(128, 32, 64, 32, num_warps=8, num_stages=3, precision=None, shared_kb=96)
    if amd:  # at D = 128 the backward's moving blocks of 32 rows spill on gfx942: 16 rows
        config = config._replace(move=16 if D > 64 else config.move, num_warps=4, num_stages=2, shared_kb=64)
    if target.shared < config.shared_kb * 1024:
        raise ValueError(f"the kernel for {str(dtype)[6:]} at head dim {D} needs {config.shared_kb} KB of shared "
                         f"memory, the GPU has {target.shared // 1024} KB")
    return config


# -----------------------------------------------------------------------------
# autograd and the public function

def _on(t):
    """The device guard: launch on t's GPU, not on the current one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _val_spans(val, width, margin, block, B, H, T):
    """With val (ascending along T): [lo, hi) of the slots each block of `block` rows may meet, as
    (R, nblocks, 2) int32 and the stride of R (0: one row of val serves every head). The block's own
    slots are always in; the margin covers fp32 rounding of |val_i - val_j| (r in [0, 1)); keys in a
    span outside the rule are masked."""
    val = val.expand(B, H, T).reshape(B * H, T) if val.dim() > 1 else val[None]  # (R, T), R = 1 or B*H
    first = torch.arange(0, T, block, device=val.device)                   # (nblocks,)
    end = (first + block).clamp(max=T)
    lo = torch.searchsorted(val, val[:, first] - width - margin)             # (R, nblocks)
    hi = torch.maximum(torch.searchsorted(val, val[:, end - 1] + width + margin), end)
    spans = torch.stack([lo, hi], -1).to(torch.int32)                      # (R, nblocks, 2)
    return spans, (0 if len(val) == 1 else spans[0].numel())


class _SlidingWindowAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, window, pos, val, margin, target):
        B, H, T, D = q.shape
        config = choose_config(q.dtype, D, target)
        q, k, v = (t.contiguous() for t in (q, k, v))      # the kernels index (B, H, T, D) as contiguous
        left = min(window, T) - 1 if val is None else 0    # |i - j| < T always holds, so cap the reach at T - 1
        right = 0 if pos is None else left                 # without pos the band is one-sided: [i - left, i]
        width = 0.0 if val is None else float(window)      # with val the band is |val_i - val_j| < width
        Pos = q if pos is None else pos.expand(B, H, T)    # (B, H, T) view with 0 strides: no copy; q is a dummy
        Val = q if val is None else val.expand(B, H, T)    # val has pos's shape, so pos's strides
        pos_strides = (0, 0, 0) if pos is None else Pos.stride()
        spans = {}  # block rows -> (spans, stride); a dummy without val
        for rows in (config.block_m, config.fixed):
            spans[rows] = (q, 0) if val is None else _val_spans(val, width, margin, rows, B, H, T)
        o = torch.empty_like(q)
        lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
        sm_scale = 1 / math.sqrt(D)
        fwd_spans, fwd_stride = spans[config.block_m]
        _attn_fwd[(triton.cdiv(T, config.block_m), B * H)](
            q, k, v, o, lse, Pos, Val, fwd_spans, *pos_strides, fwd_stride, H, T, left, right, width, sm_scale * LOG2E,
            D=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n, HAS_POS=pos is not None, HAS_VAL=val is not None,
            PRECISION=config.precision, num_warps=config.num_warps, num_stages=config.num_stages)
        bwd_spans, bwd_stride = spans[config.fixed]
        scalars = (*pos_strides, bwd_stride, H, T, left, right, width, sm_scale * LOG2E, sm_scale)  # the backward's
        bwd_options = dict(D=D, FIXED=config.fixed, MOVE=config.move, HAS_POS=pos is not None,     # non-tensor args
                           HAS_VAL=val is not None, PRECISION=config.precision, num_warps=config.num_warps,
                           num_stages=config.num_stages)
        if q.is_cuda and any(ctx.needs_input_grad[:3]):
            # Compile the backward now: a kernel that cannot run on this GPU then fails here, where
            # attention.py can still fall back to the torch path, not in the middle of backward().
            compiled = _attn_bwd.warmup(q, k, v, o, q, k, v, lse, lse, Pos, Val, bwd_spans, *scalars, grid=(1,),
                                        **bwd_options)
            if compiled is not None and compiled.metadata.shared > target.shared:  # None: a compile hook took it
                raise ValueError(f"the backward kernel needs {compiled.metadata.shared // 1024} KB of shared "
                                 f"memory, the GPU has {target.shared // 1024} KB")
        ctx.save_for_backward(q, k, v, o, lse, Pos, Val, bwd_spans)
        ctx.scalars, ctx.bwd_options, ctx.block_m = scalars, bwd_options, config.block_m
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, Pos, Val, spans = ctx.saved_tensors
        B, H, T, D = q.shape
        with _on(q):
            do = do.contiguous()
            delta = torch.empty_like(lse)                  # (B, H, T): rowsum(dO * O)
            _attn_bwd_preprocess[(triton.cdiv(T, ctx.block_m), B * H)](o, do, delta, T, D=D, BLOCK_M=ctx.block_m)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            _attn_bwd[(triton.cdiv(T, ctx.bwd_options["FIXED"]), B * H)](
                q, k, v, do, dq, dk, dv, lse, delta, Pos, Val, spans, *ctx.scalars, **ctx.bwd_options)
        return dq, dk, dv, None, None, None, None, None


def triton_swa(q, k, v, window, pos=None, val=None, margin=0.0):
    """Sliding-window attention, (B, H, T, D) -> (B, H, T, D); the rule is in attention.py's docstring:
    key j visible to query i iff |i - j| < window and pos[j] <= pos[i]; with val (fp32, pos's shape,
    ascending along T), iff |val[i] - val[j]| < window (a float: SA's value rule) and pos[j] <= pos[i].
    Raises ValueError for input it does not support (attention.BACKEND="auto" then uses the torch path)."""
    B, H, T, D = q.shape
    if val is None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    if D not in HEAD_DIMS:
        raise ValueError(f"triton_swa supports head dims {HEAD_DIMS}, got {D}; "
                         "pad the head dim or set attention.BACKEND = 'torch'")
    if q.dtype not in DTYPES or any(t.shape != q.shape or t.dtype != q.dtype or t.device != q.device for t in (k, v)):
        raise ValueError(f"q, k, v must share one shape, device and dtype of fp16/bf16/fp32, got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in (q, k, v)]}")
    if pos is not None and not (pos.dtype == torch.long and pos.device == q.device and 1 <= pos.dim() <= 3
                                and all(a in (1, b) for a, b in zip(reversed(pos.shape), (T, H, B)))):
        raise ValueError(f"pos must be a LongTensor on {q.device} broadcastable to (B, H, T)=({B}, {H}, {T}), "
                         f"got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
    if val is not None:
        if pos is None or val.dtype != torch.float32 or val.shape != pos.shape or val.device != q.device:
            raise ValueError(f"val must be fp32 with pos's shape, got {val.dtype} {tuple(val.shape)}, "
                             f"pos {None if pos is None else tuple(pos.shape)}")
        if not window > 0 or not bool((val[..., 1:] >= val[..., :-1]).all()):
            raise ValueError(f"val must be ascending along T and the width > 0, got width {window!r}")
        pos, val = pos.contiguous(), val.contiguous()      # one set of strides serves both
    with _on(q):
        return _SlidingWindowAttention.apply(q, k, v, window, pos, val, margin, device_target(q.device))


# -----------------------------------------------------------------------------
# python kernel.py [--check]: a GPU user's first minute. --check runs SWA and both SA rules through the
# kernel against attention.py's torch path (and FlexAttention on CUDA), forward and backward,
# and prints PASS/FAIL with the max error; then the speed table: kernel vs FlexAttention vs SDPA.
# Without a GPU the check runs under TRITON_INTERPRET=1 at small sizes (--check_T=100 --D=16).

if __name__ == "__main__":
    import sys

    import torch.nn.functional as F

    import attention  # only the self-check and the benchmark need the repo; the kernel does not

    B, H, D = 1, 16, 64         # bf16 speed table and check: B * H heads of dim D
    check_T = "1000,4099"        # correctness: lengths that are no multiple of any block
    check_windows = "1,64,300"
    speed_T = "1024,2048,4096,8192,16384,32768"
    W = 256                      # window of the speed table
    args = dict(a[2:].split("=", 1) if "=" in a else (a[2:], "1") for a in sys.argv[1:])
    for key, value in args.items():
        if key not in ("check", "B", "H", "D", "check_T", "check_windows", "speed_T", "W"):
            raise SystemExit(f"unknown option --{key}")
        globals()[key] = int(value) if key in ("B", "H", "D", "W") else value
    cuda = torch.cuda.is_available()
    if not cuda and not triton.knobs.runtime.interpret:
        raise SystemExit("kernel.py needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter "
                         "(the kernel's tests: python -m pytest -q test_kernel.py)")
    device = "cuda" if cuda else "cpu"
    if not cuda:
        import numpy
        numpy.seterr(all="ignore")  # the interpreter computes padding rows past T too (0 / 0); they are never stored

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.config.cache_size_limit = 64     # FlexAttention recompiles for every T and dtype
    flex = torch.compile(flex_attention)

    def out_and_grads(impl, kind, q, k, v, do, window, perm, r):
        """SWA, SA or value-rule SA by impl ("kernel", "torch" or "flex"), forward and backward:
        [out, dq, dk, dv]."""
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        T = q.shape[2]
        if impl == "flex":  # the same rules as attention.py, as mask_mods over slots, with pos = perm
            if kind == "value":
                perm = torch.argsort(r, stable=True)
                val = r[perm]
                rule = lambda b, h, i, j: ((val[i] - val[j]).abs() < window / T) & (perm[j] <= perm[i])
            else:
                perm = perm if kind == "sa" else torch.arange(T, device=q.device)
                rule = lambda b, h, i, j: ((i - j).abs() < window) & (perm[j] <= perm[i])
            mask = create_block_mask(rule, None, None, T, T, device=q.device)
            out = flex(q[:, :, perm], k[:, :, perm], v[:, :, perm], block_mask=mask)[:, :, torch.argsort(perm)]
        else:
            attention.BACKEND = "triton" if impl == "kernel" else "torch"
            out = (attention.stochastic_attention(q, k, v, window, perm) if kind == "sa" else
                   attention.stochastic_value_attention(q, k, v, window / T, r) if kind == "value"
                   else attention.sliding_window_attention(q, k, v, window))
        return [out, *torch.autograd.grad(out, (q, k, v), do)]

    if "check" in args:
        print(f"B={B} H={H} D={D} on {torch.cuda.get_device_name() if cuda else 'the CPU interpreter'}; max "
              "|error| of out, dq, dk, dv relative to max(1, |reference|); the torch path runs in fp32")
        failed = 0
        # the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): fp32 only there
        for dtype, tol in [(torch.bfloat16, 5e-2), (torch.float32, 1e-3)][0 if cuda else 1:]:
            for T in map(int, check_T.split(",")):
                for window in map(int, check_windows.split(",")):
                    g = torch.Generator().manual_seed(T + window)
                    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(4))
                    perm = torch.randperm(T, generator=g).to(device)
                    r = torch.rand(T, generator=g).to(device)
                    for kind in ("swa", "sa", "value"):
                        got = out_and_grads("kernel", kind, q, k, v, do, window, perm, r)
                        refs = dict(torch=[q.float(), k.float(), v.float(), do.float()])
                        if cuda:
                            refs["flex"] = [q, k, v, do]
                        for ref, inputs in refs.items():
                            want = out_and_grads(ref, kind, *inputs, window, perm, r)
                            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1)).item()
                                      for a, b in zip(got, want))
                            failed += err > tol
                            print(f"{kind:>5} {str(dtype)[6:]:>8} T={T:<6} window={window:<5} vs {ref:<5} "
                                  f"max err {err:.1e} (tol {tol:.0e}) {'PASS' if err <= tol else 'FAIL'}")
        if failed:
            raise SystemExit(f"{failed} checks FAILED: please report them with this output")
        print("all checks PASS")
        if not cuda:
            raise SystemExit(0)  # the speed table needs a GPU

    attention.BACKEND = "triton"                   # SA = gather + triton_swa(pos=perm) + scatter
    names = ("swa", "sa", "value", "full", "flex")
    print(f"{torch.cuda.get_device_name()}: B*H={B * H} D={D} window={W} bf16; median ms "
          "(TFLOP/s counting visible keys only, backward = 2.5x forward)")
    print(f"{'mode':>8} {'T':>6} " + " ".join(f"{n:>16}" for n in names) + f" {'full/sa':>8} {'sa/swa':>7}")
    for mode in ("fwd", "fwd+bwd"):
        for T in map(int, speed_T.split(",")):
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "fwd")
                       for _ in range(3))
            do = torch.randn_like(q)
            perm, r = torch.randperm(T, device="cuda"), torch.rand(T, device="cuda")
            mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j < W), None, None, T, T, device="cuda")
            fns = dict(swa=lambda: triton_swa(q, k, v, W),
                       sa=lambda: attention.stochastic_attention(q, k, v, W, perm),
                       value=lambda: attention.stochastic_value_attention(q, k, v, W / T, r),
                       full=lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       flex=lambda: flex(q, k, v, block_mask=mask))
            # visible (query, key) pairs: SA has as many as SWA (of two slots < W apart exactly one sees the other)
            w = min(W, T)
            visible = dict(swa=w * (w + 1) // 2 + (T - w) * w, full=T * (T + 1) // 2)
            visible["sa"] = visible["value"] = visible["flex"] = visible["swa"]  # value: in expectation
            ms, cells = {}, []
            for n, fn in fns.items():
                run = fn if mode == "fwd" else (lambda fn=fn: fn().backward(do))
                ms[n] = triton.testing.do_bench(run, grad_to_none=[q, k, v], return_mode="median")
                tflops = 4 * B * H * D * visible[n] * (1 if mode == "fwd" else 3.5) / ms[n] * 1e-9
                cells.append(f"{ms[n]:8.3f} ({tflops:5.1f})")
            ratios = f" {ms['full'] / ms['sa']:7.1f}x {ms['sa'] / ms['swa']:6.2f}x"
            print(f"{mode:>8} {T:>6} " + " ".join(cells) + ratios)
