"""
Sliding-window attention in Triton, forward and backward: triton_swa(q, k, v, window, pos).

Same semantics as attention.sliding_window_attention (stated in attention.py's
docstring): key j is visible to query i iff |i - j| < window and pos[j] <= pos[i].
Shaped like the Triton fused-attention tutorial: an inner loop over key (or
query) blocks, outer kernels, an autograd.Function, and a benchmark under
__main__. Each program visits only the blocks its window reaches, so the work
is O(T * window). Stochastic attention reuses it: attention.stochastic_attention
gathers q, k, v by perm, calls triton_swa(..., pos=perm) and scatters back.

Runs on the CPU under TRITON_INTERPRET=1 (that is how test_attention.py checks it).
Benchmark (needs a CUDA GPU): python kernel.py
"""
import math

import torch
import triton
import triton.language as tl

import attention

BLOCK_M, BLOCK_N = 128, 64      # forward: query rows per program, keys per inner step
BWD_FIXED, BWD_MOVE = 128, 32   # backward: rows a program owns (keys for dK/dV, queries for dQ), rows per inner step
NUM_WARPS, NUM_STAGES = 8, 3    # launch config; 4 warps spill registers on sm80/sm90 (checked by compiling)
DOT_PRECISION = tl.constexpr("tf32x3")  # fp32 dots: 3 TF32 passes, ~fp32 exact ("ieee" spills); fp16/bf16 ignore it
MASKED = tl.constexpr(-1.0e6)   # score of an invisible key: finite, so a fully masked row gives no NaN
LOG2E = 1.4426950408889634      # the kernels use exp2; scores are pre-scaled by log2(e)


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
def _mask(s, P, sp_t, qi, kj, w1, right, T, EDGE: tl.constexpr, HAS_POS: tl.constexpr):
    """s where key kj is visible to query qi (qi, kj broadcast to s's shape), MASKED elsewhere.
    Inside the band (EDGE False) only the position rule is left to check. Query rows past T
    need no mask: they load zeros (q, dO, delta), add nothing to dK, dV and are never stored."""
    if EDGE:
        s = tl.where((qi - kj <= w1) & (kj - qi <= right) & (kj < T), s, MASKED)
    if HAS_POS:
        pq = tl.load(P + qi * sp_t, mask=qi < T, other=0)
        pk = tl.load(P + kj * sp_t, mask=kj < T, other=0)
        s = tl.where(pk <= pq, s, MASKED)
    return s


@triton.jit
def _load(ptr, rows, T, D: tl.constexpr, EDGE: tl.constexpr):
    """(len(rows), D) tile of a contiguous (T, D) matrix; only edge blocks can run past T."""
    ptrs = ptr + rows[:, None] * D + tl.arange(0, D)[None, :]
    if EDGE:
        return tl.load(ptrs, mask=rows[:, None] < T, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _key_block(q, offs_m, start_n, K, V, P, sp_t, w1, right, T, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr):
    """k, v of the key block at start_n and the masked scores of q against it, in log2 units."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(K, offs_n, T, D, EDGE)
    v = _load(V, offs_n, T, D, EDGE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
    return k, v, _mask(s, P, sp_t, offs_m[:, None], offs_n[None, :], w1, right, T, EDGE, HAS_POS)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, P, sp_t, lo, hi, w1, right, T, qk_scale,
               D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k, v, s = _key_block(q, offs_m, start_n, K, V, P, sp_t, w1, right, T, qk_scale, D, BLOCK_N, EDGE, HAS_POS)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, P, sp_b, sp_h, sp_t, H, T, w1, right, qk_scale,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    off = bh.to(tl.int64) * T * D                     # (B, H, T, D) contiguous
    Q, K, V, O, LSE = Q + off, K + off, V + off, O + off, LSE + bh.to(tl.int64) * T
    P += (bh // H) * sp_b + (bh % H) * sp_h          # pos is expanded to (B, H, T), maybe with 0 strides
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(Q, offs_m, T, D, True)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + MASKED
    lo, mid_lo, mid_hi, hi = _span(start_m, BLOCK_M, BLOCK_N, w1, right, T)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, P, sp_t, lo, mid_lo, w1, right, T, qk_scale,
                               D, BLOCK_N, True, HAS_POS)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, P, sp_t, mid_lo, mid_hi, w1, right, T, qk_scale,
                               D, BLOCK_N, False, HAS_POS)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, K, V, P, sp_t, mid_hi, hi, w1, right, T, qk_scale,
                               D, BLOCK_N, True, HAS_POS)
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
def _bwd_dkdv_inner(dk, dv, k, v, offs_n, Q, DO, LSE, Delta, P, sp_t, lo, hi, w1, right, T, qk_scale,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr):
    """Fixed key block (k, v), moving query blocks; everything transposed: keys along rows."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(Q, offs_m, T, D, EDGE)
        do = _load(DO, offs_m, T, D, EDGE)
        lse = tl.load(LSE + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(Delta + offs_m, mask=offs_m < T, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        sT = _mask(sT, P, sp_t, offs_m[None, :], offs_n[:, None], w1, right, T, EDGE, HAS_POS)
        pT = tl.math.exp2(sT - lse[None, :])
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, offs_m, K, V, P, sp_t, lo, hi, w1, right, T, qk_scale,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr, HAS_POS: tl.constexpr):
    """Fixed query block, moving key blocks."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v, s = _key_block(q, offs_m, start_n, K, V, P, sp_t, w1, right, T, qk_scale, D, BLOCK_N, EDGE, HAS_POS)
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd(Q, K, V, DO, DQ, DK, DV, LSE, Delta, P, sp_b, sp_h, sp_t, H, T, w1, right, qk_scale, sm_scale,
              D: tl.constexpr, FIXED: tl.constexpr, MOVE: tl.constexpr, HAS_POS: tl.constexpr):
    """Program (i, bh) computes dK, dV for key block i and dQ for query block i."""
    start = tl.program_id(0) * FIXED
    bh = tl.program_id(1)
    off = bh.to(tl.int64) * T * D
    Q, K, V, DO, DQ, DK, DV = Q + off, K + off, V + off, DO + off, DQ + off, DK + off, DV + off
    LSE, Delta = LSE + bh.to(tl.int64) * T, Delta + bh.to(tl.int64) * T
    P += (bh // H) * sp_b + (bh % H) * sp_h
    rows = start + tl.arange(0, FIXED)
    tile = rows[:, None] * D + tl.arange(0, D)[None, :]   # this block's (FIXED, D) tile

    # dK, dV: query i reaches key j iff j - right <= i <= j + w1, so the span's reach is mirrored
    k = _load(K, rows, T, D, True)
    v = _load(V, rows, T, D, True)
    dk = tl.zeros([FIXED, D], dtype=tl.float32)
    dv = tl.zeros([FIXED, D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _span(start, FIXED, MOVE, right, w1, T)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, P, sp_t, lo, mid_lo, w1, right, T, qk_scale,
                             D, MOVE, True, HAS_POS)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, P, sp_t, mid_lo, mid_hi, w1, right, T, qk_scale,
                             D, MOVE, False, HAS_POS)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, rows, Q, DO, LSE, Delta, P, sp_t, mid_hi, hi, w1, right, T, qk_scale,
                             D, MOVE, True, HAS_POS)
    tl.store(DK + tile, (dk * sm_scale).to(DK.dtype.element_ty), mask=rows[:, None] < T)
    tl.store(DV + tile, dv.to(DV.dtype.element_ty), mask=rows[:, None] < T)

    # dQ
    q = _load(Q, rows, T, D, True)
    do = _load(DO, rows, T, D, True)
    lse = tl.load(LSE + rows, mask=rows < T, other=0.0)
    delta = tl.load(Delta + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([FIXED, D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _span(start, FIXED, MOVE, w1, right, T)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, P, sp_t, lo, mid_lo, w1, right, T, qk_scale,
                       D, MOVE, True, HAS_POS)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, P, sp_t, mid_lo, mid_hi, w1, right, T, qk_scale,
                       D, MOVE, False, HAS_POS)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, rows, K, V, P, sp_t, mid_hi, hi, w1, right, T, qk_scale,
                       D, MOVE, True, HAS_POS)
    tl.store(DQ + tile, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < T)


def _config(q):
    """Block sizes and launch options. Rows of 256 bytes or more (fp32 at D >= 64, fp16/bf16 at
    D = 128) halve the fixed tiles and pipeline one stage less: that fits an A100's shared memory
    and spills fewer registers (checked by compiling for sm80 and sm90, not timed)."""
    s = 2 if q.element_size() * q.shape[-1] >= 256 else 1
    return BLOCK_M // s, BLOCK_N, BWD_FIXED // s, BWD_MOVE, dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES + 1 - s)


class _SlidingWindowAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, window, pos):
        B, H, T, D = q.shape
        q, k, v = (t.contiguous() for t in (q, k, v))      # the kernels index (B, H, T, D) as contiguous
        w1 = min(window, T) - 1                            # |i - j| < T always holds, so cap the reach at T - 1
        right = 0 if pos is None else w1                   # without pos the band is one-sided: [i - w1, i]
        P = q if pos is None else pos.expand(B, H, T)      # (B, H, T) view with 0 strides: no copy; q is a dummy
        sp = (0, 0, 0) if pos is None else P.stride()
        BM, BN, _, _, opts = _config(q)
        o = torch.empty_like(q)
        lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
        sm_scale = 1 / math.sqrt(D)
        _attn_fwd[(triton.cdiv(T, BM), B * H)](q, k, v, o, lse, P, *sp, H, T, w1, right, sm_scale * LOG2E,
                                               D=D, BLOCK_M=BM, BLOCK_N=BN, HAS_POS=pos is not None, **opts)
        ctx.save_for_backward(q, k, v, o, lse, P)
        ctx.args = (sp, w1, right, sm_scale, pos is not None)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, P = ctx.saved_tensors
        sp, w1, right, sm_scale, has_pos = ctx.args
        B, H, T, D = q.shape
        BM, _, FIXED, MOVE, opts = _config(q)
        do = do.contiguous()
        delta = torch.empty_like(lse)                      # (B, H, T): rowsum(dO * O)
        _attn_bwd_preprocess[(triton.cdiv(T, BM), B * H)](o, do, delta, T, D=D, BLOCK_M=BM)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _attn_bwd[(triton.cdiv(T, FIXED), B * H)](q, k, v, do, dq, dk, dv, lse, delta, P, *sp, H, T, w1, right,
                                                  sm_scale * LOG2E, sm_scale,
                                                  D=D, FIXED=FIXED, MOVE=MOVE, HAS_POS=has_pos, **opts)
        return dq, dk, dv, None, None


def triton_swa(q, k, v, window, pos=None):
    """Sliding-window attention, (B, H, T, D) -> (B, H, T, D); the rule is in attention.py's docstring."""
    B, H, T, D = q.shape
    attention.check_positive(window)
    if D not in attention.TRITON_HEAD_DIMS:
        raise ValueError(f"triton_swa supports head dims 16, 32, 64 and 128, got {D}; "
                         "pad the head dim or set attention.BACKEND = 'torch'")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    if q.dtype not in dtypes or any(t.shape != q.shape or t.dtype != q.dtype for t in (k, v)):
        raise ValueError(f"q, k, v must share one shape and one dtype of fp16/bf16/fp32, got "
                         f"{[(tuple(t.shape), t.dtype) for t in (q, k, v)]}")
    if pos is not None and not (pos.dtype == torch.long and pos.device == q.device and 1 <= pos.dim() <= 3
                                and all(a in (1, b) for a, b in zip(reversed(pos.shape), (T, H, B)))):
        raise ValueError(f"pos must be a LongTensor on {q.device} broadcastable to (B, H, T)=({B}, {H}, {T}), "
                         f"got {pos.dtype} {tuple(pos.shape)} on {pos.device}")
    return _SlidingWindowAttention.apply(q, k, v, window, pos)


if __name__ == "__main__":
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        raise SystemExit("the kernel.py benchmark needs a CUDA GPU and none was found "
                         "(the kernel's tests run on the CPU: python -m pytest -q test_attention.py)")
    B, H, D, W = 1, 16, 64, 256                    # B * H = 16 heads of dim 64, window 256, bf16
    attention.BACKEND = "triton"                   # SA = gather + triton_swa(pos=perm) + scatter
    torch._dynamo.config.cache_size_limit = 64     # FlexAttention recompiles for every T
    flex = torch.compile(flex_attention)
    names = ("swa", "sa", "full", "flex")
    print(f"B*H={B * H} D={D} window={W} bf16; median ms (TFLOP/s counting visible keys only, backward = 2.5x forward)")
    print(f"{'mode':>8} {'T':>6} " + " ".join(f"{n:>16}" for n in names) + f" {'full/sa':>8} {'sa/swa':>7}")
    for mode in ("fwd", "fwd+bwd"):
        for T in (1024, 2048, 4096, 8192, 16384, 32768):
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "fwd")
                       for _ in range(3))
            do = torch.randn_like(q)
            perm = torch.randperm(T, device="cuda")
            mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j < W), None, None, T, T,
                                     device="cuda", _compile=True)
            fns = dict(swa=lambda: triton_swa(q, k, v, W),
                       sa=lambda: attention.stochastic_attention(q, k, v, W, perm),
                       full=lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       flex=lambda: flex(q, k, v, block_mask=mask))
            # visible (query, key) pairs: SA has as many as SWA (of two slots < W apart exactly one sees the other)
            w = min(W, T)
            visible = dict(swa=w * (w + 1) // 2 + (T - w) * w, full=T * (T + 1) // 2)
            visible["sa"] = visible["flex"] = visible["swa"]
            ms, cells = {}, []
            for n, fn in fns.items():
                run = fn if mode == "fwd" else (lambda fn=fn: fn().backward(do))
                ms[n] = triton.testing.do_bench(run, grad_to_none=[q, k, v], return_mode="median")
                tflops = 4 * B * H * D * visible[n] * (1 if mode == "fwd" else 3.5) / ms[n] * 1e-9
                cells.append(f"{ms[n]:8.3f} ({tflops:5.1f})")
            ratios = f" {ms['full'] / ms['sa']:7.1f}x {ms['sa'] / ms['swa']:6.2f}x"
            print(f"{mode:>8} {T:>6} " + " ".join(cells) + ratios)
