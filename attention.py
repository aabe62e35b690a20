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

  moba_attention(q, k, v, moba_block, top_k):
      keys are split into blocks of moba_block. Query i always attends to its
      own block (causally, j <= i) plus the top_k - 1 strictly-past blocks with
      the largest q_i . mean(K_block) (scored in fp32). top_k * moba_block >= T
      gives full attention.

Every query sees at least itself, so no row is ever fully masked, and no query
ever reads a key it may not see, not even a NaN in it. Scores and softmax are in
fp32 for every input dtype (fp16 overflows no sooner than in PyTorch's SDPA);
under torch.autocast the output has SDPA's dtype. The fast paths run the Triton
kernel (kernel.py) or the blocked torch engine (blocked.py). Speed: bench.py.
"""
import functools
import importlib.util
import math
import warnings

import torch
import torch.nn.functional as F

import blocked

# The one switch: which implementation the fast functions below run.
#   "auto":      the Triton kernel (kernel.py) for CUDA tensors, where the installed Triton is one
#                of TRITON_VERSIONS and the head dim and dtype are the kernel's; blocked.py otherwise
#   "torch":     blocked.py: O(T * window) time and memory, no T x T tensor, forward and backward
#   "triton":    the Triton kernel (also runs on the CPU under TRITON_INTERPRET=1)
#   "reference": the dense-mask O(T^2) oracle
BACKEND = "auto"
BACKENDS = ("auto", "torch", "triton", "reference")
TRITON_VERSIONS = ((3, 0), (3, 9))  # the Triton minors kernel.py is tested with, inclusive
VALUE_MARGIN = 1e-6  # the value rule's key spans reach this much past delta: fp32 rounding of |r_i - r_j| (r < 1)


def check_positive(value, name="window"):
    """value, if it is an integer >= 1 (a window, a block size, ...); else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_draw(draw, name, B, H, T):
    """SA's draw: a permutation `perm` of range(T) in every row, or finite value keys `r`; of shape
    (T,) or broadcastable to (B, H, T). O(T): a permutation's T values in range hit all T slots."""
    kind, ok = ("a LongTensor", draw.dtype == torch.long) if name == "perm" else ("a float tensor", draw.is_floating_point())
    if not ok or draw.shape[-1] != T or draw.dim() not in (1, 3):
        raise ValueError(f"{name} must be {kind} of shape (T,) or (B, H, T) with T={T}, "
                         f"got {draw.dtype} {tuple(draw.shape)}")
    if draw.dim() == 3 and draw.shape[:2] not in ((B, H), (1, H), (B, 1), (1, 1)):
        raise ValueError(f"{name} of shape {tuple(draw.shape)} does not broadcast to (B, H, T)=({B}, {H}, {T})")
    if name == "r" and not bool(draw.isfinite().all()):
        raise ValueError("r must be finite, got NaN or inf")
    if name == "perm":
        rows = draw.reshape(-1, T)                                         # (R, T)
        hit = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.clamp(0, T - 1), True)
        if not bool(hit.all() & (rows >= 0).all() & (rows < T).all()):
            raise ValueError(f"perm must be a permutation of range({T}) in every row")


def _sdpa_like(fn, any_length=False):
    """fn(q, k, v, ...) as SDPA behaves: one-line errors for shapes that do not fit, an empty output
    for T = 0, and under torch.autocast q, k, v cast to its dtype, the scores in fp32 inside."""
    @functools.wraps(fn)
    def run(q, k, v, *args, **kwargs):
        if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] \
                or not (any_length or q.shape == k.shape):
            raise ValueError(f"q, k, v must be (B, H, T, D) of one shape, got {[tuple(t.shape) for t in (q, k, v)]}")
        device = q.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                return run(q.to(dtype), k.to(dtype), v.to(dtype), *args, **kwargs)
        if q.shape[2] == 0:
            return q.new_zeros(*q.shape[:3], v.shape[3])
        return fn(q, k, v, *args, **kwargs)
    return run


@functools.lru_cache
def _triton_supported(version):
    """Whether the kernel may run with this Triton version; if not, say so once."""
    major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    if TRITON_VERSIONS[0] <= major_minor <= TRITON_VERSIONS[1]:
        return True
    warnings.warn(f"Triton {version} is outside the tested range {TRITON_VERSIONS}: using the torch path "
                  "(attention.BACKEND = 'triton' forces the kernel)")
    return False


def _backend(q):
    if BACKEND not in BACKENDS:
        raise ValueError(f"attention.BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
    if BACKEND != "auto":
        return BACKEND
    if not q.is_cuda or importlib.util.find_spec("triton") is None:
        return "torch"
    import triton
    if not _triton_supported(triton.__version__):
        return "torch"
    import kernel
    return "triton" if q.shape[-1] in kernel.HEAD_DIMS and q.dtype in kernel.DTYPES else "torch"


def _kernel(q, k, v, width, pos, val=None):
    """kernel.triton_swa, or None where BACKEND="auto" finds that it cannot compile or run on this GPU:
    then a one-line warning, and the caller takes the torch path. Any other error raises."""
    import kernel
    import triton
    cannot = (ValueError, triton.compiler.errors.CompilationError, triton.runtime.errors.OutOfResources,
              getattr(triton.runtime.errors, "PTXASError", ValueError))
    try:
        return kernel.triton_swa(q, k, v, width, pos, val, VALUE_MARGIN)
    except cannot as e:
        if BACKEND == "triton":
            raise
        cause = (str(e).strip().splitlines() or [""])[0]
        warnings.warn(f"the Triton kernel failed, using the torch path instead: {type(e).__name__}: {cause}")


# -----------------------------------------------------------------------------
# The dense references: obviously correct, O(T^2), the oracle for every test. Each
# kind's mask (the rule, written directly) sits next to its fast path below.

def full_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@functools.partial(_sdpa_like, any_length=True)
def masked_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D) where mask else -inf) @ v, the scores and softmax in fp32 (no fp16 overflow)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v                          # (B, H, T, D)


def rule_mask(val, pos, width):
    """THE rule, dense: (..., T, T) bool, True where query i may see key j:
    |val[i] - val[j]| < width and pos[j] <= pos[i]; val and pos of shape (T,) or (..., T)."""
    near = (val[..., :, None] - val[..., None, :]).abs() < width         # (..., T, T)
    return near & (pos[..., None, :] <= pos[..., :, None])


# -----------------------------------------------------------------------------
# SWA, and both SA rules through it.

def swa_mask(T, window, pos=None, device=None):
    """SWA's mask in slot order: val = the slot index, pos = arange(T) by default."""
    idx = torch.arange(T, device=device)
    return rule_mask(idx, idx if pos is None else pos, window)


@_sdpa_like
def swa_reference(q, k, v, window, pos=None):
    return masked_attention(q, k, v, swa_mask(q.shape[2], window, pos, q.device))


def _band(q, k, v, width, pos, val=None):
    """The rule over slots on the chosen backend: val None (the slot index, width = window) or
    the value rule's sorted r (width = delta); pos None is plain causal SWA."""
    backend = _backend(q)
    if backend == "reference":
        idx = torch.arange(q.shape[2], device=q.device)
        return masked_attention(q, k, v, rule_mask(idx if val is None else val, idx if pos is None else pos, width))
    if backend == "triton" and (out := _kernel(q, k, v, width, pos, val)) is not None:
        return out
    return blocked.GroupedAttention.apply(q, k, v, blocked.Band(q, width, pos, val, VALUE_MARGIN))


@_sdpa_like
def sliding_window_attention(q, k, v, window, pos=None):
    """Causal sliding-window attention, with positions: out (B, H, T, D) for q, k, v (B, H, T, D);
    key j is visible to query i iff |i - j| < window and pos[j] <= pos[i], pos (T,) or broadcastable
    to (B, H, T), default arange(T): plain SWA over the last `window` keys. Equals swa_reference."""
    return _band(q, k, v, check_positive(window), pos)


def sa_mask(window, perm):
    """SA's rank rule in ORIGINAL token order: val = each token's slot, pos = arange(T)."""
    return rule_mask(torch.argsort(perm, dim=-1), torch.arange(perm.shape[-1], device=perm.device), window)


@_sdpa_like
def sa_reference(q, k, v, window, perm):
    return masked_attention(q, k, v, sa_mask(window, perm))


def _reorder(t, idx):
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


@_sdpa_like
def stochastic_attention(q, k, v, window, perm):
    """Stochastic attention: out (B, H, T, D) for q, k, v (B, H, T, D) and perm, a permutation of
    range(T) of shape (T,) or (B, H, T). The tokens are placed in slots by perm, SWA runs over the
    slots with pos=perm (so no token sees its future) and the output returns to token order:
    tokens a >= b interact iff their slots are fewer than `window` apart. Equals sa_reference."""
    _check_draw(perm, "perm", *q.shape[:3])
    qs, ks, vs = (_reorder(t, perm) for t in (q, k, v))                 # (B, H, T, D) in slot order
    ys = sliding_window_attention(qs, ks, vs, window, pos=perm)         # (B, H, T, D) in slot order
    return _reorder(ys, torch.argsort(perm, dim=-1))                    # (B, H, T, D) in token order


def sa_value_mask(delta, r):
    """SA's value rule in token order: val = r, width = delta, pos = arange(T)."""
    return rule_mask(r, torch.arange(r.shape[-1], device=r.device), delta)


@_sdpa_like
def sa_value_reference(q, k, v, delta, r):
    return masked_attention(q, k, v, sa_value_mask(delta, r))


@_sdpa_like
def stochastic_value_attention(q, k, v, delta, r):
    """Stochastic attention by the value rule: out (B, H, T, D) for q, k, v (B, H, T, D) and r, one
    uniform key in [0, 1) per token, shape (T,) or (B, H, T): tokens a >= b interact iff
    |r_a - r_b| < delta (delta = window / T matches the rank rule's pair probability). Sorted by r,
    a block of queries sees one contiguous span of keys. Equals sa_value_reference."""
    _check_draw(r, "r", *q.shape[:3])
    if not 0 < delta:
        raise ValueError(f"delta must be > 0, got {delta!r}")
    perm = torch.argsort(r, dim=-1, stable=True)                        # (T,) or (B, H, T): ascending r
    qs, ks, vs = (_reorder(t, perm) for t in (q, k, v))                 # (B, H, T, D) in slot order
    ys = _band(qs, ks, vs, delta, perm, r.gather(-1, perm).float())     # SWA over r: per-block key spans
    return _reorder(ys, torch.argsort(perm, dim=-1))                    # (B, H, T, D) in token order


# -----------------------------------------------------------------------------
# MoBA: each query's own block plus the past blocks its router picks.

def block_means(k, moba_block):
    """(B, H, ceil(T / moba_block), D) in fp32: the mean key of each block of k (B, H, T, D), the
    last block's over the keys it has. MoBA routes on these (moba_select, and GPT's KV cache)."""
    B, H, T, D = k.shape
    nblk = math.ceil(T / moba_block)
    kpad = F.pad(k.float(), (0, 0, 0, nblk * moba_block - T))           # (B, H, nblk*moba_block, D)
    counts = torch.full((nblk,), moba_block, device=k.device)
    counts[-1] = T - (nblk - 1) * moba_block
    return kpad.view(B, H, nblk, moba_block, D).sum(3) / counts[:, None]  # (B, H, nblk, D)


@torch.no_grad()  # routing is a hard choice: no gradient flows through it, as in MoBA
def moba_select(q, k, moba_block, top_k):
    """MoBA's routing, shared by both MoBA paths so they pick identical blocks; scored in fp32,
    as MoBA's own code does. Returns (B, H, T, top_k-1) indices of the chosen strictly-past
    blocks and a validity mask of the same shape (early queries have fewer past blocks)."""
    B, H, T, D = q.shape
    nblk = math.ceil(T / moba_block)
    kmean = block_means(k, moba_block)                                  # (B, H, nblk, D)
    idx, ok = [], []
    step = max(1, blocked.CHUNK // (B * H * nblk))  # query rows per step: the scores are O(T^2 / moba_block)
    for s in range(0, T, step):
        rows = torch.arange(s, min(s + step, T), device=q.device)
        with torch.autocast(q.device.type, enabled=False):
            scores = q[:, :, rows].float() @ kmean.transpose(-1, -2)    # (B, H, rows, nblk)
        past = torch.arange(nblk, device=q.device) < (rows // moba_block)[:, None]  # (rows, nblk)
        top, i = scores.masked_fill(~past, float("-inf")).topk(min(top_k - 1, nblk), dim=-1)  # (B, H, rows, n)
        idx.append(i)
        ok.append(top > float("-inf"))
    return torch.cat(idx, 2), torch.cat(ok, 2)


def moba_mask(q, k, moba_block, top_k):
    """MoBA's rule: (B, H, T, T) bool, True where query i sees key j: j <= i, in i's own block
    or in one of the blocks moba_select picked for i."""
    T = q.shape[2]
    idx, ok = moba_select(q, k, moba_block, top_k)
    chosen = torch.zeros(*idx.shape[:3], math.ceil(T / moba_block), dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, idx, ok)                                         # (B, H, T, nblk)
    blk = torch.arange(T, device=q.device) // moba_block
    chosen[..., torch.arange(T), blk] = True                             # own block
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return chosen[..., blk] & causal                                     # (B, H, T, T)


@_sdpa_like
def moba_reference(q, k, v, moba_block, top_k):
    return masked_attention(q, k, v, moba_mask(q, k, moba_block, top_k))


@_sdpa_like
def moba_attention(q, k, v, moba_block, top_k):
    """MoBA (Mixture of Block Attention): out (B, H, T, D) for q, k, v (B, H, T, D). Keys are split
    into blocks of moba_block; query i sees its own block causally plus the top_k - 1 strictly-past
    blocks whose mean key scores highest against q_i (moba_select). Equals moba_reference."""
    check_positive(moba_block, "moba_block")
    check_positive(top_k, "top_k")
    if _backend(q) == "reference":
        return moba_reference(q, k, v, moba_block, top_k)
    return blocked.GroupedAttention.apply(q, k, v, blocked.Moba(q, moba_block, *moba_select(q, k, moba_block, top_k)))
