"""
Causal attention functions: full, sliding-window (SWA), stochastic (SA) and MoBA.

Every function takes q, k, v of shape (B, H, T, D) and returns (B, H, T, D).

THE RULES (stated once; the dense references, the blocked torch path and the
Triton kernel in kernel.py all follow them, and test_attention.py checks that):

  sliding_window_attention(q, k, v, window, pos):
      key j is visible to query i  iff  |i - j| < window  and  pos[j] <= pos[i].
      pos is a LongTensor of shape (T,) or one broadcastable to (B, H, T); it
      defaults to arange(T). With the default, that is plain causal SWA,
      i - window < j <= i: `window` keys including itself (FlashAttention's
      window_size=(window-1, 0)). With pos given, the band reaches window-1
      slots on BOTH sides and causality acts on pos, not on the slot index.

  stochastic_attention(q, k, v, window, perm):
      perm is a permutation of range(T), shape (T,) or (B, H, T); slot s of the
      permuted sequence holds original token perm[s]. Gather q, k, v by perm,
      run sliding_window_attention(..., window, pos=perm) and scatter the output
      back. So tokens a and b (a >= b) interact iff their slots are fewer than
      `window` apart: no token ever sees its future, a query sees about
      `window` keys on average, window >= T gives full attention for any perm,
      and the identity perm gives SWA.

  moba_attention(q, k, v, block_size, top_k):
      keys are split into blocks of block_size. Query i always attends to its
      own block (causally, j <= i) plus the top_k - 1 strictly-past blocks with
      the largest q_i . mean(K_block). top_k * block_size >= T gives full attention.

Every query sees at least itself, so no row is ever fully masked; masks still
use a finite large negative so that padding rows can never produce NaN.
"""
import importlib.util
import math

import torch
import torch.nn.functional as F

# The one switch: which implementation the fast functions below run.
#   "auto":      the Triton kernel (kernel.py) for CUDA tensors with a head dim it supports,
#                the blocked torch path otherwise
#   "torch":     the blocked torch path: O(T * window) time and memory, no T x T tensor
#   "triton":    the Triton kernel (also runs on the CPU under TRITON_INTERPRET=1)
#   "reference": the dense-mask O(T^2) oracle
BACKEND = "auto"
BACKENDS = ("auto", "torch", "triton", "reference")
BLOCK = 64        # query rows per block in the blocked torch path
CHUNK = 1 << 18   # score elements computed per step in the blocked torch path


def check_positive(value, name="window"):
    """value, if it is an integer >= 1 (a window, a block size, ...); else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_perm(perm, B, H, T):
    if perm.dtype != torch.long or perm.shape[-1] != T or perm.dim() not in (1, 3):
        raise ValueError(f"perm must be a LongTensor of shape (T,) or (B, H, T) with T={T}, "
                         f"got {perm.dtype} {tuple(perm.shape)}")
    if perm.dim() == 3 and perm.shape[:2] not in ((B, H), (1, H), (B, 1), (1, 1)):
        raise ValueError(f"perm of shape {tuple(perm.shape)} does not broadcast to (B, H, T)=({B}, {H}, {T})")


def _backend(q):
    if BACKEND not in BACKENDS:
        raise ValueError(f"attention.BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
    if BACKEND == "auto":
        if not q.is_cuda or importlib.util.find_spec("triton") is None:
            return "torch"
        import kernel
        return "triton" if q.shape[-1] in kernel.HEAD_DIMS and q.dtype in kernel.DTYPES else "torch"
    return BACKEND


def _masked_softmax_av(scores, mask, v):
    """softmax(scores where mask else -big) @ v, the softmax in fp32."""
    scores = scores.float().masked_fill_(~mask, torch.finfo(torch.float32).min)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


# -----------------------------------------------------------------------------
# Dense-mask references: obviously correct, O(T^2), the oracle for every test.

def swa_mask(T, window, pos=None, device=None):
    """The rule itself: (..., T, T) bool, True where query i may see key j."""
    idx = torch.arange(T, device=device)
    pos = idx if pos is None else pos
    band = (idx[:, None] - idx[None, :]).abs() < window                  # (T, T)
    return band & (pos[..., None, :] <= pos[..., :, None])               # (..., T, T)


def sa_mask(window, perm):
    """SA's mask in ORIGINAL token order: tokens a >= b interact iff their slots are < window apart."""
    slot = torch.argsort(perm, dim=-1)                                   # slot[t]: where token t sits
    idx = torch.arange(perm.shape[-1], device=perm.device)
    near = (slot[..., :, None] - slot[..., None, :]).abs() < window      # (..., T, T)
    return near & (idx[None, :] <= idx[:, None])


@torch.no_grad()  # routing is a hard choice: no gradient flows through it, as in MoBA
def moba_select(q, k, block_size, top_k):
    """MoBA's routing, shared by both MoBA paths so they pick identical blocks.
    Returns (B, H, T, top_k-1) indices of the chosen strictly-past blocks and a
    validity mask of the same shape (early queries have fewer past blocks)."""
    B, H, T, D = q.shape
    nblk = math.ceil(T / block_size)
    n = min(top_k - 1, nblk)
    kpad = F.pad(k, (0, 0, 0, nblk * block_size - T))                    # (B, H, nblk*bs, D)
    counts = torch.full((nblk,), block_size, device=k.device)
    counts[-1] = T - (nblk - 1) * block_size
    kmean = kpad.view(B, H, nblk, block_size, D).sum(3) / counts[:, None]  # (B, H, nblk, D)
    idx, ok = [], []
    step = max(1, CHUNK // (B * H * nblk))  # query rows per step: the scores are O(T^2 / block_size)
    for s in range(0, T, step):
        rows = torch.arange(s, min(s + step, T), device=q.device)
        scores = (q[:, :, rows] @ kmean.transpose(-1, -2)).float()      # (B, H, rows, nblk)
        past = torch.arange(nblk, device=q.device) < (rows // block_size)[:, None]  # (rows, nblk)
        top, i = scores.masked_fill(~past, float("-inf")).topk(n, dim=-1)  # (B, H, rows, n)
        idx.append(i)
        ok.append(top > float("-inf"))
    return torch.cat(idx, 2), torch.cat(ok, 2)


def full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def masked_attention(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])          # (B, H, T, T)
    return _masked_softmax_av(scores, mask, v)


def swa_reference(q, k, v, window, pos=None):
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, pos, q.device))


def sa_reference(q, k, v, window, perm):
    return masked_attention(q, k, v, sa_mask(window, perm))


def moba_reference(q, k, v, block_size, top_k):
    T = q.shape[2]
    idx, ok = moba_select(q, k, block_size, top_k)
    nblk = math.ceil(T / block_size)
    chosen = torch.zeros(*idx.shape[:3], nblk, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)                                         # (B, H, T, nblk)
    blk = torch.arange(T, device=q.device) // block_size
    chosen[..., torch.arange(T), blk] = True                             # own block
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return masked_attention(q, k, v, chosen[..., blk] & causal)          # (B, H, T, T)


# -----------------------------------------------------------------------------
# Blocked torch path: O(T * window) time and memory.

def _swa_blocked(q, k, v, window, pos=None):
    """Query block b (BLOCK rows) attends to one contiguous key span of length
    L = BLOCK + left + right around it, taken as an overlapping unfold view.
    Padding slots get positions that make the rule mask them by itself: left
    pads are 'in everyone's future', right pads only see themselves."""
    B, H, T, D = q.shape
    w = min(window, T)                                  # |i - j| < T always holds
    C = min(BLOCK, 1 << (T - 1).bit_length())           # block rows; small T needs no 64-row block
    nb = math.ceil(T / C)
    Tp = nb * C
    left, right = w - 1, (0 if pos is None else w - 1)  # the band's reach in slots
    L = C + left + right
    big = torch.iinfo(torch.long).max
    pos = torch.arange(T, device=q.device) if pos is None else pos
    lead = pos.shape[:-1]
    pos = torch.cat([pos.new_full((*lead, left), big), pos,
                     torch.arange(T, Tp + right, device=q.device).expand(*lead, -1)], -1)  # (..., left+Tp+right)
    pos_q = pos[..., left:left + Tp].unflatten(-1, (nb, C))             # (..., nb, C)
    pos_k = pos.unfold(-1, L, C)                                        # (..., nb, L)
    r, c = torch.arange(C, device=q.device), torch.arange(L, device=q.device)
    band = (r[:, None] + left - c[None, :]).abs() < w                   # (C, L): same for every block

    qb = (F.pad(q, (0, 0, 0, Tp - T)) / math.sqrt(D)).unflatten(2, (nb, C))  # (B, H, nb, C, D)
    kw = F.pad(k, (0, 0, left, Tp - T + right)).unfold(2, L, C)         # (B, H, nb, D, L)
    vw = F.pad(v, (0, 0, left, Tp - T + right)).unfold(2, L, C).transpose(-1, -2)  # (B, H, nb, L, D)
    # A few query blocks at a time, so the (.., C, L) scores stay in cache: this
    # loop makes the CPU path several times faster than one big batched matmul.
    step = max(1, CHUNK // (B * H * C * L))
    ys = []
    for s in range(0, nb, step):
        blk = slice(s, s + step)
        mask = band & (pos_k[..., blk, None, :] <= pos_q[..., blk, :, None])  # (..., step, C, L)
        ys.append(_masked_softmax_av(qb[:, :, blk] @ kw[:, :, blk], mask, vw[:, :, blk]))  # (B, H, step, C, D)
    y = torch.cat(ys, 2)                                                # (B, H, nb, C, D)
    return y.flatten(2, 3)[:, :, :T]                                    # (B, H, T, D)


def _moba_gathered(q, k, v, block_size, top_k):
    """Each query's scores are its own block (causal) plus its chosen past
    blocks, gathered by index; one softmax over both parts."""
    B, H, T, D = q.shape
    bs = block_size
    nblk = math.ceil(T / bs)
    Tp = nblk * bs
    scale = 1 / math.sqrt(D)
    kb = F.pad(k, (0, 0, 0, Tp - T)).unflatten(2, (nblk, bs))           # (B, H, nblk, bs, D)
    vb = F.pad(v, (0, 0, 0, Tp - T)).unflatten(2, (nblk, bs))           # (B, H, nblk, bs, D)
    qb = F.pad(q, (0, 0, 0, Tp - T)).unflatten(2, (nblk, bs))           # (B, H, nblk, bs, D)
    own = (qb @ kb.transpose(-1, -2)) * scale                           # (B, H, nblk, bs, bs)
    own_mask = torch.ones(bs, bs, dtype=torch.bool, device=q.device).tril().expand(nblk, bs, bs)

    idx, ok = moba_select(q, k, bs, top_k)                              # (B, H, T, n)
    n = idx.shape[-1]
    idx = F.pad(idx, (0, 0, 0, Tp - T)).unflatten(2, (nblk, bs))        # (B, H, nblk, bs, n)
    ok = F.pad(ok, (0, 0, 0, Tp - T)).unflatten(2, (nblk, bs))          # (B, H, nblk, bs, n)
    bh = (torch.arange(B, device=q.device)[:, None, None, None, None],
          torch.arange(H, device=q.device)[None, :, None, None, None])
    ksel = kb[bh + (idx,)].flatten(-3, -2)                              # (B, H, nblk, bs, n*bs, D)
    vsel = vb[bh + (idx,)].flatten(-3, -2)                              # (B, H, nblk, bs, n*bs, D)
    past = (qb.unsqueeze(-2) @ ksel.transpose(-1, -2)).squeeze(-2) * scale  # (B, H, nblk, bs, n*bs)
    past_mask = ok.repeat_interleave(bs, dim=-1)                        # (B, H, nblk, bs, n*bs)

    scores = torch.cat([own, past], -1).float()                         # (B, H, nblk, bs, bs + n*bs)
    mask = torch.cat([own_mask.expand_as(own), past_mask], -1)
    p = torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float32).min), -1).to(v.dtype)
    y = p[..., :bs] @ vb + (p[..., bs:].unsqueeze(-2) @ vsel).squeeze(-2)  # (B, H, nblk, bs, D)
    return y.flatten(2, 3)[:, :, :T]                                    # (B, H, T, D)


# -----------------------------------------------------------------------------
# The functions the model calls.

def sliding_window_attention(q, k, v, window, pos=None):
    check_positive(window)
    backend = _backend(q)
    if backend == "reference":
        return swa_reference(q, k, v, window, pos)
    if backend == "triton":
        import kernel
        if BACKEND == "triton":
            return kernel.triton_swa(q, k, v, window, pos)
        try:  # "auto": a GPU the kernel cannot run on (see kernel.choose_config) gets the torch path, not a crash
            return kernel.triton_swa(q, k, v, window, pos)
        except Exception as e:
            import warnings
            cause = (str(e).strip().splitlines() or [""])[0]
            warnings.warn(f"the Triton kernel failed, using the torch path instead: {type(e).__name__}: {cause}")
    return _swa_blocked(q, k, v, window, pos)


def _take(t, idx):
    """t (B, H, T, D) with its rows in idx's order, idx of shape (T,) or (B, H, T):
    out[b, h, s] = t[b, h, idx[b, h, s]]. Indexes by row, never by element."""
    if idx.dim() == 1:
        return t.index_select(2, idx)                                   # (B, H, T, D)
    B, H = t.shape[:2]
    b = torch.arange(B, device=t.device)[:, None, None]                 # (B, 1, 1)
    h = torch.arange(H, device=t.device)[None, :, None]                 # (1, H, 1)
    return t[b, h, idx.expand(B, H, -1)]                                # (B, H, T, D)


def stochastic_attention(q, k, v, window, perm):
    B, H, T, D = q.shape
    _check_perm(perm, B, H, T)
    qs, ks, vs = (_take(t, perm) for t in (q, k, v))                    # (B, H, T, D) in slot order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)        # (B, H, T, D) in slot order
    return _take(ys, torch.argsort(perm, dim=-1))                      # (B, H, T, D) in token order


def moba_attention(q, k, v, block_size, top_k):
    check_positive(block_size, "block_size"), check_positive(top_k, "top_k")
    if _backend(q) == "reference":
        return moba_reference(q, k, v, block_size, top_k)
    return _moba_gathered(q, k, v, block_size, top_k)


# -----------------------------------------------------------------------------
# CPU benchmark of the torch paths against full attention:
#   python attention.py [--sizes=1024,4096,16384] [--json=path]
# Each case runs in a fresh process so that its peak resident memory can be read.

if __name__ == "__main__":
    import json
    import resource
    import statistics
    import subprocess
    import sys
    import time

    B, H, D, W = 1, 8, 64, 256
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])

    if "case" in args:  # one measurement, in this fresh process
        kind, T = args["case"].split(","), None
        kind, T = kind[0], int(kind[1])
        torch.manual_seed(0)
        q, k, v = torch.randn(3, B, H, T, D).unbind(0)
        perm = torch.randperm(T)
        fn = {"full": lambda: full_attention(q, k, v),
              "swa-ref": lambda: swa_reference(q, k, v, W),
              "sa-ref": lambda: sa_reference(q, k, v, W, perm),
              "swa": lambda: _swa_blocked(q, k, v, W),
              "sa": lambda: stochastic_attention(q, k, v, W, perm)}[kind]
        BACKEND = "torch"
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times = []
        with torch.no_grad():
            for _ in range(6):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB above the inputs
        print(statistics.median(times[1:]), peak / 1024)
        sys.exit()

    lines = [f"forward, fp32, B={B} H={H} D={D} window={W}, torch {torch.__version__}, {torch.get_num_threads()} "
             "threads; median of 5 after a warm-up; peak RSS above the inputs",
             f"{'T':>6} {'kind':>8} {'ms':>9} {'peak MiB':>9} {'full/this':>10}"]
    print("\n".join(lines), flush=True)
    rows = []
    for T in map(int, args.get("sizes", "1024,4096,16384").split(",")):
        res = {}
        for kind in ("full", "swa-ref", "sa-ref", "swa", "sa"):
            if kind.endswith("ref") and T > 4096:
                continue  # the dense reference would need ~3 * H * T^2 * 4 bytes (> 20 GB)
            out = subprocess.run([sys.executable, __file__, f"--case={kind},{T}"], capture_output=True, text=True,
                                 check=True)
            ms, mib = (float(x) for x in out.stdout.split())
            res[kind] = ms
            rows.append(dict(T=T, kind=kind, ms=1000 * ms, peak_mib=mib))
            lines.append(f"{T:>6} {kind:>8} {1000 * ms:>9.1f} {mib:>9.0f} {res['full'] / ms:>9.1f}x")
            print(lines[-1], flush=True)
        lines.append(f"{'':>6} {'sa/swa':>8} {res['sa'] / res['swa']:>9.2f}x (the floor is 2x: SA's band is two-sided)")
        print(lines[-1], flush=True)
    if "json" in args:
        with open(args["json"], "w") as f:
            json.dump(dict(rows=rows, table="\n".join(lines)), f, indent=1)
