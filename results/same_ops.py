"""
Whether a refactor changed what runs: the aten ops (name and input shapes, counted) of one fwd+bwd of every fast
attention kind, in another checkout's attention.py against this one's, on the same inputs. Identical ops mean
identical speed, which a shared machine's timings cannot show to 10% (results/README.md, section 4).

    git worktree add /tmp/base 48febeb && python results/same_ops.py --base=/tmp/base
"""
import importlib
import os
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
base = ""                # the other checkout's root
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
    setattr(module, next(n for n in ("ENGINE", "IMPL", "BACKEND") if hasattr(module, n)), "torch")  # older: IMPL...
    return module


if __name__ == "__main__":
    if not os.path.isfile(os.path.join(base, "attention.py")):
        sys.exit(f"same_ops.py: --base={base!r} holds no attention.py (a checkout of this repo, e.g. a git worktree)")
    modules = {"base": load(base), "this": load(ROOT)}
    B, H, T, D, w = 1, 2, 1000, 64, 64
    g = torch.Generator().manual_seed(0)
    perm, perms, r = torch.randperm(T, generator=g), torch.rand(B, H, T, generator=g).argsort(-1), torch.rand(T)
    kinds = {"full": lambda A, q, k, v: A.full_attention(q, k, v),
             "swa": lambda A, q, k, v: A.sliding_window_attention(q, k, v, w),
             "sa": lambda A, q, k, v: A.stochastic_attention(q, k, v, w, perm),
             "sa (B, H, T)": lambda A, q, k, v: A.stochastic_attention(q, k, v, w, perms),
             "sa-value": lambda A, q, k, v: A.stochastic_value_attention(q, k, v, w / T, r),
             "moba": lambda A, q, k, v: A.moba_attention(q, k, v, 64, 4)}
    print(f"{'kind':13} {'base ops':>9} {'ops here':>9}  differing (name, input shapes)")
    for kind, f in kinds.items():
        data = [torch.randn(B, H, T, D, generator=g) for _ in range(3)]             # (B, H, T, D) each
        ops = {}
        for name, A in modules.items():
            q, k, v = (t.clone().requires_grad_() for t in data)
            f(A, q, k, v).sum().backward()                                          # warm-up: caches, lazy imports
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                f(A, q, k, v).sum().backward()
            ops[name] = Counter((e.name, str(e.input_shapes)) for e in prof.events() if e.name.startswith("aten::"))
        differing = (ops["this"] - ops["base"]) + (ops["base"] - ops["this"])
        print(f"{kind:13} {sum(ops['base'].values()):9} {sum(ops['this'].values()):9}  {len(differing)}", flush=True)
