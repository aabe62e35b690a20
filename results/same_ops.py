"""
Whether a refactor changed what runs: the aten ops (name and input shapes, counted) of one fwd+bwd of every fast
attention kind, in another checkout's attention.py against this one's, on the same inputs. Identical ops mean
identical speed, which a shared machine's timings cannot show to 10%. Each checkout runs in its own process: both
register the same custom ops (sa::band, sa::moba), and in one process the second registration served both.

    git worktree add /tmp/base 48febeb && python results/same_ops.py --base=/tmp/base
"""
import importlib
import json
import os
import subprocess
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
base = ""                # the other checkout's root
side = ""                # internal: a checkout whose ops this process prints, as JSON
sys.path.insert(0, ROOT)  # the configurator's guards.py
exec(open(os.path.join(ROOT, "configurator.py")).read())


def load(path):
    """attention.py (with the guards.py, tiled.py or blocked.py and kernel.py beside it) of the checkout at path, on the
    torch engine."""
    for name in ("attention", "guards", "blocked", "tiled", "kernel"):
        sys.modules.pop(name, None)
    sys.path.insert(0, path)
    module = importlib.import_module("attention")
    sys.path.pop(0)
    setattr(module, next(n for n in ("ATTN_ENGINE", "ENGINE", "IMPL", "BACKEND") if hasattr(module, n)), "torch")  # older: IMPL...
    return module


def ops(A):
    """{kind: Counter of (aten op, input shapes)} of one fwd+bwd of each kind through attention module A."""
    B, H, T, D, w = 1, 2, 1000, 64, 64
    g = torch.Generator().manual_seed(0)
    perm, r = torch.randperm(T, generator=g), torch.rand(T, generator=g)
    perms = torch.rand(B, H, T, generator=g).argsort(-1)  # (B, H, T)
    kinds = {"full": lambda q, k, v: A.full_attention(q, k, v),
             "swa": lambda q, k, v: A.sliding_window_attention(q, k, v, w),
             "sa": lambda q, k, v: A.stochastic_attention(q, k, v, w, perm),
             "sa (B, H, T)": lambda q, k, v: A.stochastic_attention(q, k, v, w, perms),
             "sa-value": lambda q, k, v: A.stochastic_value_attention(q, k, v, w / T, r),
             "moba": lambda q, k, v: A.moba_attention(q, k, v, 64, 4)}
    counts = {}
    for kind, f in kinds.items():
        q, k, v = (torch.randn(B, H, T, D, generator=g).requires_grad_() for _ in range(3))  # (B, H, T, D) each
        f(q, k, v).sum().backward()                                                          # warm-up: lazy imports
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            f(q, k, v).sum().backward()
        counts[kind] = Counter(f"{e.name} {e.input_shapes}" for e in prof.events() if e.name.startswith("aten::"))
    return counts


if __name__ == "__main__":
    if side:
        print(json.dumps(ops(load(side))))
        sys.exit()
    if not os.path.isfile(os.path.join(base, "attention.py")):
        sys.exit(f"same_ops.py: --base={base!r} holds no attention.py (a checkout of this repo, e.g. a git worktree)")
    counts = {name: {kind: Counter(c) for kind, c in json.loads(subprocess.run(
        [sys.executable, __file__, f"--side={path}"], capture_output=True, text=True, check=True).stdout.splitlines()[
        -1]).items()} for name, path in (("base", base), ("this", ROOT))}
    print(f"{'kind':13} {'base ops':>9} {'ops here':>9}  differing (name, input shapes)")
    for kind, here in counts["this"].items():
        there = counts["base"][kind]
        differing = (here - there) + (there - here)
        print(f"{kind:13} {sum(there.values()):9} {sum(here.values()):9}  {len(differing)}", flush=True)
