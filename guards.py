"""Support, skipped on a first reading: the input checks, one call at the door of each public function. A bad input
raises InputError, printed as one line (one_line); any other exception is a bug, with its traceback."""
import math
import numbers
import operator
import os
import re
import sys
import tempfile

# torch is imported where used: prepare_data.py runs without it
FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
FP32_TINY = 1.1754943508222875e-38  # its smallest normal


class InputError(ValueError):
    """A bad setting, file or tensor; its one-line message names it and the fix."""


def need(ok, message):
    if not ok:
        raise InputError(message)


def one_line(kind, error, tb):
    """sys.excepthook (configurator.py sets it): an InputError or Ctrl-C as one line."""
    if issubclass(kind, (InputError, KeyboardInterrupt)):
        print(str(error) or "interrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, error, tb)


# Each setting's range, by name, for every script that has the setting (configurator.py checks types first):
# {name: (check(value, settings) -> True, False or what is wrong, the fix)}. A name is one setting everywhere (top_k:
# sampling's cut-off; MoBA's is moba_topk).

def device_problem(device):
    """Why device (a str) is unusable here, or None."""
    import torch
    if not re.fullmatch(r"cpu(:0)?|cuda(:\d+)?", device):
        return "use cpu, cuda or cuda:N"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "CUDA is not available here: use --device=cpu"


def nearest_dir(path):
    """path if a directory, else the nearest above it; None if a file is in the way."""
    d = os.path.abspath(path or ".")
    while not os.path.isdir(d):
        if os.path.exists(d):
            return None
        d = os.path.dirname(d)
    return d


def file_problem(path):
    """Why path is no file to read, or None."""
    return None if os.path.isfile(path) else "is a directory, not a file" if os.path.isdir(path) else "not found"


def path_problem(path, is_file=False):
    """Why path cannot be written as a directory (is_file: a file), or None."""
    if os.path.isdir(path) if is_file else os.path.isfile(path):
        return f"it is a {'directory' if is_file else 'file'}, not a {'file' if is_file else 'directory'}"
    d = nearest_dir(os.path.dirname(path) if is_file else path)
    if d is None:
        return "a file stands where a directory of it should be"
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError as e:
        return f"cannot write to {path} ({e.strerror or e} in {d}): choose a writable path"


CHECKS = {
    **dict.fromkeys("eval_interval log_interval eval_iters batch_size gradient_accumulation_steps num_samples seeds "
                    "moba_topk block_size window moba_chunk n_layer n_head n_embd mqar_seq_len mqar_num_pairs "
                    "mqar_num_queries mqar_train_seqs mqar_val_seqs hf_val_docs jobs reps threads heads head_dim "
                    "flex_block batch n max_layers train_iters".split(), (lambda x, s: x >= 1, "use an integer >= 1")),
    "temperature": (lambda x, s: x >= 0, "use a number > 0, or 0 for greedy decoding"),
    "top_k": (lambda x, s: x >= 0, "use a value >= 1, or 0 to sample among all tokens"),
    "mqar_vocab": (lambda x, s: x >= 3, "use an integer >= 3"),
    "learning_rate": (lambda x, s: 0 < x <= FP32_MAX, "use a value > 0 that fp32 holds"),
    "min_lr": (lambda x, s: 0 <= x <= s.get("learning_rate", x), "use a value from 0 to learning_rate"),
    **dict.fromkeys(("beta1", "beta2"), (lambda x, s: 0 <= x < 1, "AdamW's betas lie in [0, 1)")),
    "dropout": (lambda x, s: 0 <= x < 1, "use a value in [0, 1)"),
    "hf_max_docs": (lambda x, s: x == 0 or s.get("dataset") == "fineweb-edu" and x > s.get("hf_val_docs", 0),
                    "use 0 (all), or on fineweb-edu more than hf_val_docs, which val takes first"),
    "val_fraction": (lambda x, s: 0 < x < 1, "it must lie between 0 and 1"),
    "rope_base": (lambda x, s: x > 1, "use a number > 1 (10000 is usual)"),
    "copy_task": (lambda x, s: not x or s.get("block_size", 0) % 2 == 0, "it needs an even block_size (two halves)"),
    "tokenizer": (lambda x, s: x == "bytes" or bool(s.get("input_file") or s.get("adopt")), "it applies to "
                  "--input_file and --adopt only"),
    "dtype": (lambda x, s: x in ("float32", "bfloat16", "float16"), "use one of float32, bfloat16, float16"),
    "device": (lambda x, s: device_problem(x) or True, None),
    "backend": (lambda x, s: x in ("", "nccl", "gloo", "mpi", "ucc", "xccl"), "use \"\" (nccl on CUDA, gloo on the "
                "CPU) or one of nccl, gloo, mpi, ucc, xccl"),
    "attn_engine": (lambda x, s: x in ("auto", "torch", "triton", "dense"), "use one of auto, torch, triton, dense"),
    "out_dir": (lambda x, s: x != "" and (path_problem(x) or True), "name a directory"),
    "overwrite": (lambda x, s: x or s.get("init_from") == "resume" or not os.path.exists(p := os.path.join(
        s["out_dir"], "ckpt.pt")) or f"{p} exists: continue it with --init_from=resume, train in a new --out_dir, or "
        "replace it with --overwrite=True", None),
    "json_out": (lambda x, s: not x or path_problem(x, is_file=True) or True, None),
    "dataset": (lambda x, s: x == os.path.basename(x) and x not in (".", ".."), "use a plain name, no path (it names "
                "data_root/<dataset>/)"),
}


def setting_problem(name, value, settings=None):
    """What is wrong with setting name's value (CHECKS; any number: finite, >= 0 if not named), or None."""
    rule, why = CHECKS.get(name, (None, None))
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not math.isfinite(value) or isinstance(value, int) and not -2**63 <= value < 2**63:
        return "use a finite number" + " (an integer within 64 bits)" * isinstance(value, int)
    if rule is None or value is None:
        return f"use {'an integer' if isinstance(value, int) else 'a value'} >= 0" if number and value < 0 else None
    got = rule(value, settings or {})
    return None if got is True else got if isinstance(got, str) else why


def memory(device):
    import torch
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(device, n_layer, n_embd, vocab_size, batch_size, T):
    """One line, not the OOM killer, for a model (n_params a lower bound) or a batch too large for device."""
    n_params, have = n_layer * 12 * n_embd ** 2 + vocab_size * n_embd, memory(device)  # the layers, the embedding
    states, logits = 16 * n_params, 8 * batch_size * T * vocab_size  # fp32 logits and their gradient
    has = f"{device} has {have / 2**30:,.0f} GiB"
    need(states <= have, f"n_layer={n_layer}, n_embd={n_embd}, vocab_size={vocab_size}: {n_params / 1e9:,.1f}B "
         f"parameters need {states / 2**30:,.0f} GiB for weights, gradients and AdamW's moments; {has}: make them "
         "smaller")
    need(states + logits <= have, f"batch_size={batch_size}: {batch_size} sequences of {T} tokens need "
         f"{logits / 2**30:,.0f} GiB for their logits alone; {has}: use fewer")


# Files

def schema_problem(record, schema, required=()):
    """What is wrong with record, or None: a dict with the required entries, each passing its test in schema:
    {entry: (test(value, record) -> True, False or what is wrong, what it must be)}."""
    if not isinstance(record, dict):
        return f"it is {shown(record)}, not a dict of entries"
    if missing := [k for k in required if k not in record]:
        return f"no {' and no '.join(map(repr, missing))} entry"
    for entry, (test, want) in schema.items():
        got = entry not in record or test(record[entry], record)
        if got is not True:
            return f"{entry!r} {got}" if isinstance(got, str) else f"{entry!r} is {shown(record[entry])}, not {want}"
    return None


def check_schema(record, schema, where, required=()):
    """An InputError naming where and schema_problem's finding, if any."""
    problem = schema_problem(record, schema, required)
    need(problem is None, f"{where}: {problem}: it was edited, or is not what this repo writes")


def shown(x):
    """x, for a one-line message."""
    if type(x).__name__ in ("Tensor", "Parameter"):
        return f"a {str(x.dtype)[6:]} tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 40 and "\n" not in text else f"a {type(x).__name__}"


def count(x):
    """Whether x is an integer >= 0 (True is no count)."""
    return type(x) is int and x >= 0


# Tensors

def check_count(value, name, least=1):
    """value if an integer >= least (Python's or numpy's, not a bool), else an InputError naming it."""
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= least
    except TypeError:
        ok = False
    need(ok, f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_delta(delta):
    """delta, the value rule's width, if a number >= FP32_TINY (below it, a query's own key hides); inf: every key."""
    need(isinstance(delta, numbers.Real) and not isinstance(delta, bool) and delta >= FP32_TINY,  # False for NaN
         f"delta must be a number >= {FP32_TINY:.2g} (fp32's smallest normal), got {delta!r}")
    return delta


def check_inputs(q, k, v, any_length=False, **args):
    """q, k, v (B, H, T, D) of one shape (any_length: keys of their own length), in autocast's dtype under it, as SDPA
    casts them; and by name window, moba_chunk, moba_topk, delta, mask, perm, r, pos. It reads the values of a perm or
    r only once: a tensor that passed, or that checked() marked, is not read again until it changes (on a GPU, reading
    a value waits for the GPU)."""
    import torch
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        raise InputError(f"q, k, v must be tensors, got {type(q).__name__}, {type(k).__name__}, {type(v).__name__}")
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] \
            or not (any_length or q.shape == k.shape):
        raise InputError(f"q, k, v must be (B, H, T, D) of one shape, got {[tuple(t.shape) for t in (q, k, v)]}")
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):  # softmax @ v truncates ints
        raise InputError(f"q, k, v must be floating point, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device or q.is_meta:
        raise InputError(f"q, k, v must be on one device that holds data, got {q.device}, {k.device}, {v.device}")
    if torch.is_autocast_enabled(q.device.type):  # whatever the inputs' dtypes
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    elif not q.dtype == k.dtype == v.dtype:  # as SDPA: no silent cast to q's dtype
        raise InputError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, T = q.shape[:3]
    for name, x in args.items():
        if name == "delta":
            check_delta(x)
        if name in ("window", "moba_chunk", "moba_topk") and (type(x) is not int or x < 1):
            check_count(x, name)  # an integer >= 1 of numpy's passes, any other value is refused
        if name == "mask" and not (isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.dim() <= 4 and all(
                n in (1, m) for n, m in zip(x.shape[::-1], (k.shape[2], T, H, B)))):
            raise InputError(f"mask must be a bool tensor broadcastable to (B, H, T, S)=({B}, {H}, {T}, {k.shape[2]}), "
                             f"got {shown(x)}")
        if name not in ("perm", "r", "pos") or x is None and name == "pos":
            continue
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() if name == "r" else x.dtype == torch.long) \
                or not (x.dim() == 1 or x.dim() == 3 and x.shape[0] in (1, B) and x.shape[1] in (1, H)) \
                or x.shape[-1] != T:
            raise InputError(f"{name} must be {'a float tensor' if name == 'r' else 'a LongTensor'} of shape (T,) or "
                             f"broadcastable to (B, H, T)=({B}, {H}, {T}), got {shown(x)}")
        if x.device != q.device:
            raise InputError(f"{name} must be on q's device {q.device}, got {x.device}")
        if name == "pos" or not x.numel() or torch.compiler.is_compiling():  # pos: any values; tracing: none known
            continue
        if not x.is_inference() and getattr(x, "checked_version", None) == x._version:  # checked, unchanged since
            continue
        rows = x.reshape(-1, T)  # (R, T)
        if name == "r" and not bool(rows.isfinite().all()):
            raise InputError("r must be finite, got NaN or inf")
        if name == "perm":
            hit = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.clamp(0, T - 1), True)  # (R, T): O(T)
            if not bool(hit.all() & (rows >= 0).all() & (rows < T).all()):
                raise InputError(f"perm must be a permutation of range({T}) in every row")
        checked(x)
    return q, k, v


def checked(t):
    """t, marked as checked until it changes in place (by its version counter, blind to writes through .data or
    numpy): check_inputs then skips its values. The model marks its SA draws (model.sa_draw), check_inputs what passed.
    Inference tensors keep no version: never marked, they are checked at every call."""
    import torch
    if not torch.compiler.is_compiling() and not t.is_inference():
        t.checked_version = t._version
    return t


def check_tokens(idx, config, targets=None, cache=None, draws=None, sampling=None):
    """For config's model: GPT.forward's door (idx, targets, cache, draws) and generate's (sampling: max_new_tokens,
    temperature, top_k)."""
    import torch
    for name, t, least in [("idx", idx, 0)] + ([("targets", targets, -1)] if targets is not None else []):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.long, torch.int) or t.is_meta \
                or name == "targets" and t.shape != idx.shape:
            raise InputError(f"{name} must be a (B, T) tensor of token ids (int64 or int32) of idx's shape, with data "
                             f"(not on meta), got {shown(t)}")
        if t.numel() and t.device.type == "cpu" and not torch.compiler.is_compiling() and not (
                least <= t.numpy().min() and t.numpy().max() < config.vocab_size):  # no wait: a GPU's embedding asserts
            raise InputError(f"{name} holds token ids outside [{least}, vocab_size={config.vocab_size})")
    start, T = 0 if cache is None else cache.start, idx.shape[1]
    if start + T > config.block_size and sampling is None:  # generate crops to the last block_size tokens
        raise InputError(f"sequence length {start + T} exceeds block_size {config.block_size}")
    if cache is not None and start and T > 1:
        raise InputError(f"a KV cache takes one token at a time after the prompt; got {T} at {start}")
    if cache is not None and cache.config != config:  # another model's, or this one's before a swap_attention
        raise InputError("this KV cache was made for another config: make a new KVCache(config)")
    if sampling is not None:
        max_new_tokens, temperature, top_k = sampling
        check_count(max_new_tokens, "max_new_tokens", least=0)
        need(isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and temperature >= 0,
             f"temperature={temperature!r}: {CHECKS['temperature'][1]}")  # NaN fails too
        if top_k is not None:
            check_count(top_k, "top_k (None: sample among all tokens)")
        need(T > 0, f"idx of shape {tuple(idx.shape)}: use a prompt (B, T) of at least one token")
    if draws is not None and (not isinstance(draws, (list, tuple)) or len(draws) != config.n_layer):  # zip: stops short
        raise InputError(f"draws must be a list of one draw per layer, {config.n_layer}, got a "
                         f"{type(draws).__name__}" + (f" of {len(draws)}" if isinstance(draws, (list, tuple)) else ""))
