"""
Checkpoints, written so that nothing is lost and read so that nothing surprises: save_checkpoint writes
atomically, and load_checkpoint never executes code (weights_only=True) and turns a missing, corrupt,
foreign, incomplete, hand-edited (an entry of another type or range) or diverged (NaN) file into one
line: train.py, sample.py, eval.py and results/reproduce.py read checkpoints through it. check_device is
the device and dtype check that train.py, sample.py, eval.py and bench.py share.
"""
import os
import re

import torch

from model import DTYPES, GPT, GPTConfig
from prepare_data import meta_problem, shown

RNG_BYTES = torch.get_rng_state().numel()  # a CPU generator's state: torch's, the sampler's and SA's (sa_state)
SCALER = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
          "_growth_tracker": int}  # GradScaler.state_dict() with fp16


def check_device(device, dtype):
    """A one-line ValueError unless this machine can run on device (cpu, cuda, cuda:N) in dtype."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device={device!r}: use cpu, cuda or cuda:N")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available here: use --device=cpu")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if device != "cpu" and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype={dtype!r}: this GPU has no bf16 (before Ampere): use --dtype=float16")


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then os.replace: a crash mid-write leaves the old checkpoint whole."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def state(x):
    """A generator state (or another value) in a one-line message."""
    if torch.is_tensor(x):
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    return shown(x)


def rng_problem(states):
    """What is wrong with a checkpoint's "rng" (train.py's rng_states: a list of each rank's states), or None."""
    if not (isinstance(states, list) and states):
        return f"is {shown(states)}, not a list of each rank's RNG states"
    u32 = lambda x: type(x) is int and 0 <= x < 2**32  # noqa: E731
    for rank, s in enumerate(states):
        if not isinstance(s, dict):
            return f"has rank {rank}'s states as {shown(s)}, not a dict"
        np_state, py_state = s.get("numpy"), s.get("python")
        wants = [(k, torch.is_tensor(s.get(k)) and s[k].dtype == torch.uint8 and s[k].shape == (RNG_BYTES,),
                  f"a uint8 tensor of shape ({RNG_BYTES},)") for k in ("torch", "sampler", "sa")]
        wants += [("cuda", "cuda" not in s or torch.is_tensor(s["cuda"]) and s["cuda"].dtype == torch.uint8
                   and s["cuda"].dim() == 1, "a uint8 tensor"),
                  ("numpy", isinstance(np_state, (tuple, list)) and len(np_state) == 5 and np_state[0] == "MT19937"
                   and isinstance(np_state[1], list) and len(np_state[1]) == 624 and all(map(u32, np_state[1]))
                   and type(np_state[2]) is int and 0 <= np_state[2] <= 624 and np_state[3] in (0, 1)
                   and isinstance(np_state[4], float), "numpy's ('MT19937', 624 words, position, has_gauss, gauss)"),
                  ("python", isinstance(py_state, tuple) and len(py_state) == 3 and py_state[0] == 3
                   and isinstance(py_state[1], tuple) and len(py_state[1]) == 625 and all(map(u32, py_state[1]))
                   and (py_state[2] is None or isinstance(py_state[2], float)), "random.getstate()'s (3, 625 words, "
                   "gauss)")]
        key, want = next(((k, want) for k, ok, want in wants if not ok), (None, None))
        if key:
            return f"has rank {rank}'s {key!r} state as {state(s.get(key))}, not {want}"
    return None


def entry_problem(ckpt):
    """What is wrong with the first entry of ckpt, a train.py checkpoint, whose type or range is not what train.py
    writes, as "'entry' is ..." or "'entry' has ...", or None. Entries that are not there are not checked."""
    args = ckpt["model_args"]
    if not isinstance(args, dict) or "attn" not in args or args.keys() - GPTConfig.__dataclass_fields__.keys():
        return "'model_args' are not GPTConfig's fields"  # GPTConfig checks their values
    if not (isinstance(ckpt["model"], dict) and all(torch.is_tensor(v) for v in ckpt["model"].values())):
        return f"'model' is {shown(ckpt['model'])}, not a state_dict (a dict of tensors)"
    wants = [("iter_num", lambda n: type(n) is int and n >= 0, "an integer >= 0"),
             ("best_val_loss", lambda x: isinstance(x, float) and x >= 0, "a loss (a float >= 0, inf at first)"),
             ("config", lambda c: isinstance(c, dict), "a dict"),
             ("optimizer", lambda o: isinstance(o, dict) and isinstance(o.get("state"), dict)
              and isinstance(o.get("param_groups"), list), "an optimizer's state_dict"),
             ("scaler", lambda sc: isinstance(sc, dict) and (not sc or sc.keys() == SCALER.keys() and all(
                 type(sc[k]) is t and sc[k] >= 0 for k, t in SCALER.items())),
              "a GradScaler's state_dict ({} but with fp16)")]
    key, want = next(((k, want) for k, ok, want in wants if k in ckpt and not ok(ckpt[k])), (None, None))
    if key:
        return f"{key!r} is {shown(ckpt[key])}, not {want}"
    if "meta" in ckpt and meta_problem(ckpt["meta"], data=False):
        return f"'meta' {meta_problem(ckpt['meta'], data=False)}"
    return "'rng' " + rng_problem(ckpt["rng"]) if "rng" in ckpt and rng_problem(ckpt["rng"]) else None


def load_checkpoint(path, device="cpu", require=()):
    """(model, ckpt) from a train.py checkpoint. Loaded with weights_only=True onto the CPU,
    where the RNG states it holds must stay; the model is then moved to device. require: the
    entries the caller reads besides model and model_args (train.py's resume: optimizer, rng, ...).
    A missing, corrupt or foreign file, a missing entry, an entry of another type or range than train.py
    writes (entry_problem) or NaN weights raise a one-line ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} not found: train one with train.py, which writes out_dir/ckpt.pt")
    check_device(str(device), "float32")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zips, random bytes and pickles of arbitrary classes all land here
        raise ValueError(f"checkpoint {path} is unreadable ({type(e).__name__}): it is corrupt, truncated, or holds "
                         "more than tensors and plain Python values; restore it or train again") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} holds a {type(ckpt).__name__}, not a checkpoint of this repo (a dict from train.py)")
    missing = [k for k in ("model", "model_args", *require) if k not in ckpt]
    if missing:  # train.py writes every entry; an older train.py no meta, other tools no iter_num
        writer = f"train.py at iteration {ckpt['iter_num']}" if "iter_num" in ckpt else "another program than train.py"
        raise ValueError(f"{path} has no {' and no '.join(map(repr, missing))} entry: it was written by {writer}; "
                         "use a checkpoint that this repo's train.py wrote")
    problem = entry_problem(ckpt)
    if problem:
        raise ValueError(f"{path}: its {problem}: the file was edited or written by other code; use a checkpoint "
                         "that train.py wrote")
    try:
        with torch.device("meta"):  # shapes only: model_args that do not fit the weights allocate nothing
            shapes = GPT(GPTConfig(**ckpt["model_args"]))
    except ValueError as e:
        raise ValueError(f"{path} has an incompatible config: {e}") from None
    expected = shapes.state_dict()
    saved = ckpt["model"]
    mismatched = sorted(expected.keys() ^ saved.keys()) + sorted(
        k for k in expected.keys() & saved.keys() if (expected[k].shape, expected[k].dtype) != (saved[k].shape,
                                                                                                saved[k].dtype))
    if mismatched:
        raise ValueError(f"{path}: its weights do not fit its model_args ({len(mismatched)} mismatched entries, "
                         f"e.g. {mismatched[:3]}): the file was edited or written by other code")
    need = sum(t.numel() * t.element_size() for t in [*shapes.parameters(), *shapes.buffers()])  # RoPE's tables too
    if need > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        raise ValueError(f"{path}: its model_args make a model of {need / 2**30:,.0f} GiB, more than this machine's "
                         "memory: the file was edited or written by other code")
    nan = [k for k, v in saved.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nan:
        raise ValueError(f"{path}: {len(nan)} weights hold NaN or inf (e.g. {nan[0]}): the run that wrote it diverged; "
                         "train again with a lower learning_rate")
    model = GPT(shapes.config)
    model.load_state_dict(saved)
    return model.to(device), ckpt
