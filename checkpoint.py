"""
Checkpoints, written so that nothing is lost and read so that nothing surprises: save_checkpoint writes
atomically, and load_checkpoint never executes code (weights_only=True) and turns a missing, corrupt,
foreign, incomplete or diverged (NaN) file into one line. check_device is the device and dtype check
that train.py, sample.py, eval.py and bench.py share.
"""
import os
import re

import torch

from model import DTYPES, GPT, GPTConfig


def check_device(device, dtype):
    """A one-line ValueError unless this machine can run on device (cpu, cuda, cuda:N) in dtype."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
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


def load_checkpoint(path, device="cpu", require=()):
    """(model, ckpt) from a train.py checkpoint. Loaded with weights_only=True onto the CPU,
    where the RNG states it holds must stay; the model is then moved to device. require: the
    entries the caller reads besides model and model_args (train.py's resume: optimizer, rng, ...).
    A missing, corrupt or foreign file, a missing entry or NaN weights raise a one-line ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} not found: train one with train.py, which writes out_dir/ckpt.pt")
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
    args = ckpt["model_args"]
    if not isinstance(args, dict) or "attn" not in args or args.keys() - GPTConfig.__dataclass_fields__.keys():
        raise ValueError(f"{path} is not a checkpoint of this repo: its 'model_args' are not GPTConfig's fields")
    try:
        model = GPT(GPTConfig(**args))
    except ValueError as e:
        raise ValueError(f"{path} has an incompatible config: {e}") from None
    expected, saved = model.state_dict(), ckpt["model"]
    mismatched = sorted(expected.keys() ^ saved.keys()) + sorted(
        k for k in expected.keys() & saved.keys() if expected[k].shape != saved[k].shape)
    if mismatched:
        raise ValueError(f"{path}: its weights do not fit its model_args ({len(mismatched)} mismatched entries, "
                         f"e.g. {mismatched[:3]}): the file was edited or written by other code")
    nan = [k for k, v in saved.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nan:
        raise ValueError(f"{path}: {len(nan)} weights hold NaN or inf (e.g. {nan[0]}): the run that wrote it diverged; "
                         "train again with a lower learning_rate")
    model.load_state_dict(saved)
    return model.to(device), ckpt
