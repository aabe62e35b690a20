"""
Checkpoints: nothing is lost. save_checkpoint writes atomically; load_checkpoint never executes code
(weights_only=True) and turns a missing, corrupt or foreign file into one line.
"""
import os

import torch

from model import GPT, GPTConfig


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then os.replace: a crash mid-write leaves the old checkpoint whole."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, device="cpu"):
    """(model, ckpt) from a train.py checkpoint. Loaded with weights_only=True onto the CPU,
    where the RNG states it holds must stay; the model is then moved to device.
    A missing, corrupt or foreign file raises a one-line ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} not found: train one with train.py, which writes out_dir/ckpt.pt")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zips, random bytes and pickles of arbitrary classes all land here
        raise ValueError(f"checkpoint {path} is unreadable ({type(e).__name__}): it is corrupt, truncated, or holds "
                         "more than tensors and plain Python values; restore it or train again") from None
    args = ckpt.get("model_args") if isinstance(ckpt, dict) else None
    if not isinstance(args, dict) or "model" not in ckpt or "attn" not in args or args.keys() - GPTConfig.__dataclass_fields__.keys():
        raise ValueError(f"{path} is not a checkpoint of this repo: it needs 'model' and 'model_args' with GPTConfig's fields")
    try:
        model = GPT(GPTConfig(**args))
    except ValueError as e:
        raise ValueError(f"{path} has an incompatible config: {e}") from None
    ours, theirs = model.state_dict(), ckpt["model"]
    bad = sorted(ours.keys() ^ theirs.keys()) + sorted(k for k in ours.keys() & theirs.keys() if ours[k].shape != theirs[k].shape)
    if bad:
        raise ValueError(f"{path}: its weights do not fit its model_args ({len(bad)} mismatched entries, e.g. {bad[:3]}): "
                         "the file was edited or written by other code")
    model.load_state_dict(theirs)
    return model.to(device), ckpt
