"""The input checks of the library, one place for each kind of input, each problem one ValueError line: q, k, v
taken as PyTorch's scaled_dot_product_attention (SDPA) takes them, with a NaN or inf in v kept from the queries that
cannot see its key (attention.py's functions run inside these two wrappers); SA's draws, windows, deltas, seeds and
the model's tokens (attention.py, model.py, kv_cache.py). The scripts' settings are configurator.py's to check, and
files are their loaders' (prepare_data.load_meta and load_tokens, checkpoint.load_checkpoint, tasks.load_task_file).
"""
import functools
import math

import torch


def sdpa_inputs(fn, any_length=False):
    """fn(q, k, v, ...) taking q, k, v as SDPA does: tensors (B, H, T, D) of one shape (any_length: keys of their
    own T), floating point (softmax @ v would truncate integers), of one device and one dtype (under autocast,
    its dtype); an empty B, H, T or D gives SDPA's empty output, on the autograd graph."""
    @functools.wraps(fn)
    def run(q, k, v, *args, **kwargs):
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            raise ValueError(f"q, k, v must be tensors, got {', '.join(type(t).__name__ for t in (q, k, v))}")
        if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] \
                or not (any_length or q.shape == k.shape):
            raise ValueError(f"q, k, v must be (B, H, T, D) of one shape, got {[tuple(t.shape) for t in (q, k, v)]}")
        if not all(t.is_floating_point() for t in (q, k, v)):
            raise ValueError(f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
        if not q.device == k.device == v.device:
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
        if torch.is_autocast_enabled(device := q.device.type):
            with torch.autocast(device, enabled=False):
                return run(*(t.to(torch.get_autocast_dtype(device)) for t in (q, k, v)), *args, **kwargs)
        if not q.dtype == k.dtype == v.dtype:  # as SDPA: no silent cast of the others to q's dtype
            raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.numel() == 0 or k.numel() == 0:  # a B, H, T or D of 0
            return q.new_zeros(*q.shape[:3], v.shape[3]) + (q.sum() + k.sum() + v.sum())
        return fn(q, k, v, *args, **kwargs)
    return run


def v_seen_only(fn):
    """fn(q, k, v, ...), rule fixed by the rest, where non-finite v[j, d] reaches out[i, d] only if query i sees key j
    (p @ v has 0 * NaN = NaN). Fast: one sum shows v finite (as blocked._finite). Else fn on v's non-finite entries
    zeroed, NaN where fn on q = k = 0 (visible keys weigh >= 1/T, hidden 0) reads them: no path changes. Eager only."""
    @functools.wraps(fn)
    def run(q, k, v, *args, **kwargs):
        if torch.compiler.is_compiling() or bool(v.sum().isfinite()):    # compiled: bool() would break the graph
            return fn(q, k, v, *args, **kwargs)
        nonfinite = ~v.isfinite()                                           # (B, H, T, D)
        with torch.no_grad():
            seen = fn(torch.zeros_like(q), torch.zeros_like(k), nonfinite.to(v.dtype), *args, **kwargs) > 0
        return fn(q, k, v.masked_fill(nonfinite, 0), *args, **kwargs).masked_fill(seen, math.nan)  # (B, H, T, D)
    return run


def check_int(value, name="window", least=1):
    """value, if it is an integer >= least (a window, a block size, a count, ...); else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_seed(seed):
    """seed, if an integer of 64 bits (what torch.Generator.manual_seed takes); else a ValueError."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must be an integer that fits in 64 bits, got {seed!r}")
    return seed


def check_temperature(temperature):
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature >= 0):  # NaN
        raise ValueError(f"temperature={temperature!r}: use a number > 0, or 0 for greedy decoding")


def check_tokens(idx, vocab_size, lengths=None, targets=None):
    """A model's input: idx a (B, T) int64 (or int32) tensor of ids in [0, vocab_size); targets None or ids of idx's
    shape, -1 where ignored; lengths None or the real tokens of each right-padded row, a (B,) integer tensor with
    1 <= lengths <= T."""
    for name, t, least in [("idx", idx, 0)] + ([("targets", targets, -1)] if targets is not None else []):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.long, torch.int) or \
                name == "targets" and t.shape != idx.shape:
            raise ValueError(f"{name} must be a (B, T) tensor of token ids (int64) of idx's shape, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.numel() and not torch.compiler.is_compiling() and not (least <= t.min() and t.max() < vocab_size):
            raise ValueError(f"{name} holds token ids outside [{least}, vocab_size={vocab_size})")
    (B, T), ok = idx.shape, isinstance(lengths, torch.Tensor) and lengths.dtype in (torch.long, torch.int)
    if lengths is not None and not (ok and lengths.shape == (B,) and bool(((lengths >= 1) & (lengths <= T)).all())):
        raise ValueError(f"lengths must be a (B,)=({B},) integer tensor of real tokens per row, 1 <= lengths <= T={T}, "
                         f"got {' '.join(str(lengths).split())[:80]}")


def check_draw(draw, name, q):
    """draw, if it is SA's draw for q's rows: permutations `perm` of range(T) or finite value keys `r` (or SWA's
    positions `pos`, any integers, None by default); (T,) or broadcastable to (B, H, T), on q's device."""
    if name == "pos" and draw is None:
        return None
    (B, H, T), kind = q.shape[:3], "a float tensor" if name == "r" else "a LongTensor"
    if not isinstance(draw, torch.Tensor):
        raise ValueError(f"{name} must be {kind} of shape (T,) or (B, H, T), got {type(draw).__name__}")
    ok = draw.is_floating_point() if name == "r" else draw.dtype == torch.long
    if not ok or draw.dim() not in (1, 3) or any(n not in (1, m) for n, m in zip(draw.shape[:-1], (B, H))) \
            or draw.shape[-1] != T:
        raise ValueError(f"{name} must be {kind} of shape (T,) or broadcastable to (B, H, T)=({B}, {H}, {T}), "
                         f"got {draw.dtype} {tuple(draw.shape)}")
    if draw.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {draw.device}")
    if torch.compiler.is_compiling() or name == "pos":  # values unknown while tracing (eager only); pos: any integers
        return draw
    rows = draw.reshape(-1, T)                                          # (R, T)
    if name == "r" and not bool(rows.isfinite().all()):
        raise ValueError("r must be finite, got NaN or inf")
    if name == "perm":
        hit = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.clamp(0, T - 1), True)  # (R, T): O(T)
        if not bool(hit.all() & (rows >= 0).all() & (rows < T).all()):
            raise ValueError(f"perm must be a permutation of range({T}) in every row")
    return draw


def check_delta(delta):
    """delta, if it is a width for the value rule: a number (inf: every key) no smaller than fp32's smallest normal,
    below which the rule's fp32 comparison would round it to 0 and hide even a query's own key."""
    tiny = torch.finfo(torch.float32).tiny
    if not (isinstance(delta, (int, float)) and not isinstance(delta, bool) and tiny <= delta):  # False for NaN
        raise ValueError(f"delta must be a number >= {tiny:.2g} (fp32's smallest normal), got {delta!r}")
    return delta
