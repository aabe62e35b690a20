"""
The byte-level language model in miniature: claim 4 (pure SA has worse perplexity), claim 5 in plain perplexity, and
claim 6(b)'s LM swap (a trained full-attention model's attention swapped without training, the loss split into
long-range and local tokens). Steps lm and swap of results/reproduce.py; the helpers (copy_distance, visible_keys,
the sink baseline, nll) serve far_copy.py too.
"""
import math
import os
import statistics

import common
from common import evals, mean_std, train_all

KINDS = ["full", "swa", "sa", "sa+swa"]
# config/quick.py for each kind and seed; --fast: a few iterations
SIZES = dict(iters=500, seeds=[0, 1], eval_interval=50, extra={})
FAST = dict(iters=6, seeds=[0], eval_interval=3, extra=dict(eval_iters=2))
SWAP = dict(fractions=[32, 16, 8, 4, 2], seeds=3, tokens=131072)  # windows T / fractions, tokens // T val sequences
SWAP_FAST = dict(fractions=[32, 8], seeds=2, tokens=2048)


def sizes():
    return FAST if common.fast else SIZES


def data():
    """data_root holding pystdlib, bytes (prepare_data.py writes it once)."""
    path = os.path.join(common.work, "data")
    common.run("prepare_data.py", "--dataset=pystdlib", f"--data_root={path}")
    return path


def lm():
    """Byte-level language modelling on pystdlib: config/quick.py for each kind and seed."""
    size, root = sizes(), data()
    rows, curves = [], {}
    runs = [(kind, seed) for kind in KINDS for seed in size["seeds"]]
    dirs = [os.path.join(common.work, f"lm-{kind}-s{seed}") for kind, seed in runs]
    train_all([(od, dict(presets=["config/quick.py"], data_root=root, attn=kind, seed=seed, max_iters=size["iters"],
                         eval_interval=size["eval_interval"], **size["extra"]))
               for (kind, seed), od in zip(runs, dirs)])
    for (kind, seed), od in zip(runs, dirs):
        log = evals(od)
        curves[f"{kind}/{seed}"] = [(r["iter"], r["val_loss"]) for r in log]
        rows.append(dict(attn=kind, seed=seed, val_loss=log[-1]["val_loss"],
                         val_bpb=log[-1]["val_loss"] / math.log(2), wall_s=log[-1]["elapsed_s"]))
    common.save("lm.json", dict(iters=size["iters"], config="config/quick.py", runs=rows, curves=curves))

    p = common.plt()
    fig, ax = p.subplots(figsize=(5.5, 3.6))
    for i, kind in enumerate(KINDS):
        for seed in size["seeds"]:
            pts = curves[f"{kind}/{seed}"][1:]
            ax.plot(*zip(*pts), color=f"C{i}", alpha=1 if seed == size["seeds"][0] else 0.5,
                    label=kind if seed == size["seeds"][0] else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("val loss (nats per byte)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "lm.png"), dpi=120)


def lm_summary(doc):
    lines = ["| attn | val loss | val bits per byte | wall time per run |", "|---|---|---|---|"]
    for kind in KINDS:
        rs = [r for r in doc["runs"] if r["attn"] == kind]
        lines.append(f"| {kind} | {mean_std([r['val_loss'] for r in rs])} | {mean_std([r['val_bpb'] for r in rs])} "
                     f"| {statistics.mean(r['wall_s'] for r in rs):.0f} s |")
    return "\n".join(lines)


# The LM swap: the full-attention byte LM that lm trained, its attention swapped
# without training, the loss split into long-range and local tokens (copy_distance), every kind placed
# at the keys its queries measurably see (visible_keys).
SWAP_KINDS = ("swa", "sink", "sa", "moba")  # sink: SWA + the first token (sink_attention)
CONTEXT = 8  # bytes of context that make a repeat (copy_distance)


def moba_budget(window):
    """MoBA's chunks at a window's key budget, as eval.py's swaps: 4 chunks of window // 4."""
    return dict(moba_chunk=max(1, window // 4), moba_topk=4)


def sink_mask(T, window, device=None):
    """SWA's mask plus an attention sink: every query also sees token 0, the first of its sequence."""
    import attention
    mask = attention.swa_mask(T, window, device=device)                        # (T, T)
    mask[:, 0] = True  # token 0 precedes every query: still causal
    return mask


def sink_attention(q, k, v, window):
    """The SWA + sink baseline, dense (O(T^2): fine at T=256): attention.masked_attention with sink_mask.
    Pretrained models put much attention on the first token; SWA takes it away, sink gives it back.
    Applied by swapped_nll in place of attention.sliding_window_attention, so attention.py stays as it is."""
    import attention
    return attention.masked_attention(q, k, v, sink_mask(q.shape[2], window, q.device))


def lm_val(n, T):
    """n sequences of T + 1 bytes spread evenly over the LM's val split: inputs and targets, (n, T) each."""
    import numpy as np
    import torch

    from prepare_data import load_meta, load_tokens
    path = os.path.join(common.work, "data", "pystdlib")
    tokens = load_tokens(path, "val", load_meta(path))
    starts = np.linspace(0, len(tokens) - T - 1, n).astype(np.int64)
    seqs = torch.from_numpy(np.stack([np.asarray(tokens[s:s + T + 1], np.int64) for s in starts]))  # (n, T + 1)
    return seqs[:, :-1], seqs[:, 1:]


def copy_distance(x, y, context=CONTEXT):
    """How far back the nearest copy of each prediction lies: (N, T) for byte inputs and targets x, y
    (N, T), -1 where there is none. The query at t reads x[..t] and predicts y[t] = x[t+1]. A copy is an
    earlier query j < t with the same `context` bytes x[j-context+1..j] = x[t-context+1..t] and the same
    target y[j] = y[t]; the byte to copy, y[j] = x[j+1], stands t - (j+1) tokens before the query, and
    the nearest copy is the one with the largest j. SWA with window w sees the keys t-w+1..t, so a token
    is LONG-RANGE at w when its distance is >= w: it repeats an earlier occurrence, and SWA sees none
    (an induction head under full attention can copy it). Every other token is LOCAL at w."""
    import numpy as np
    N, T = x.shape
    dist = np.full((N, T), -1, np.int64)
    for n in range(N):
        row = bytes(np.concatenate([x[n], y[n, -1:]]).astype(np.uint8))       # T + 1 bytes
        last = {}  # context + target -> the latest query that had them
        for t in range(context - 1, T):
            gram = row[t - context + 1:t + 2]
            if gram in last:
                dist[n, t] = t - last[gram] - 1
            last[gram] = t
    return dist


def visible_keys(kind, window, T, draws=64):
    """The mean number of keys the query at each position sees, (T,), counted on the masks: attention.py's
    (SA over `draws` permutations), sink_mask. MoBA's count does not depend on its routing (its own chunk
    up to the query, plus moba_topk - 1 whole past chunks while there are that many), so random q, k
    give it. Over all T queries SA sees exactly as many keys as SWA at the same window: a permutation
    keeps T - d token pairs at slot distance d, and the later token of each pair sees the earlier; SA
    spreads them, late queries seeing up to 2 * window - 1 keys, early ones fewer."""
    import torch

    import attention
    if kind == "full":
        return torch.arange(1., T + 1)
    if kind == "sa":
        g = torch.Generator().manual_seed(0)
        return sum(attention.sa_mask(window, torch.randperm(T, generator=g)).sum(-1) for _ in range(draws)) / draws
    if kind == "moba":
        q, k = torch.randn(2, 1, 1, T, 8, generator=torch.Generator().manual_seed(0))  # (1, 1, T, 8) each
        mb = moba_budget(window)
        return attention.moba_mask(q, k, mb["moba_chunk"], mb["moba_topk"])[0, 0].sum(-1).float()
    return (sink_mask(T, window) if kind == "sink" else attention.swa_mask(T, window)).sum(-1).float()


def swapped_nll(model, kind, window, x, y, batch=16):
    """The loss of each prediction of x -> y, (N, T) numpy, with the model's attention swapped to
    `kind` (a model kind, or sink: swa with sink_attention in its place) at `window`, no training."""
    import contextlib
    import unittest.mock

    import attention
    model.swap_attention(attn="swa" if kind == "sink" else kind,
                         **({} if kind == "full" else dict(window=window, **moba_budget(window))))
    sink = unittest.mock.patch.object(attention, "sliding_window_attention", sink_attention)
    with sink if kind == "sink" else contextlib.nullcontext():
        return nll(model, x, y, batch)


def nll(model, x, y, batch=16):
    """The model's loss on each prediction of x -> y, (N, T) numpy."""
    import torch
    import torch.nn.functional as F
    with torch.no_grad():
        return torch.cat([F.cross_entropy(model(x[i:i + batch])[0].transpose(1, 2), y[i:i + batch], reduction="none")
                          for i in range(0, len(x), batch)]).numpy()           # (N, T)


def swap(swap_T="256"):
    """The LM swap at each context length of swap_T, a comma list (swap_at)."""
    for T in str(swap_T).split(","):
        swap_at(int(T))


def swap_at(T):
    """Training-free, the paper's protocol in miniature: the full-attention byte LM from lm (4 layers, 4
    heads, T=256; another T trains its own, config/quick.py at that block_size, and writes swap_T<T>.json)
    evaluated with swa, swa + sink, sa (SWAP["seeds"] permutation draws) and moba at windows
    w = T / SWAP["fractions"], on SWAP["tokens"] // T val sequences. The loss is split by copy_distance into
    long-range and local tokens at each window; each kind's keys are measured (visible_keys), over all queries
    and over the long-range tokens' queries, and the plot compares the kinds at equal measured keys."""
    import numpy as np

    from checkpoint import load_checkpoint
    size, sw = sizes(), SWAP_FAST if common.fast else SWAP
    seed, suffix = size["seeds"][0], "" if T == 256 else f"_T{T}"
    name = f"lm-full-s{seed}" if T == 256 else f"lm-full-T{T}-s{seed}"
    if T != 256:
        train_all([(os.path.join(common.work, name), dict(presets=["config/quick.py"], data_root=data(), attn="full",
                                                          seed=seed, block_size=T, max_iters=size["iters"],
                                                          eval_interval=size["eval_interval"]))])
    model, _ = load_checkpoint(os.path.join(common.work, name, "ckpt.pt"))
    model.eval()
    windows = [T // f for f in sw["fractions"]]
    x, y = lm_val(sw["tokens"] // T, T)                                        # (N, T) each
    dist = copy_distance(x.numpy(), y.numpy())                                 # (N, T)
    full = swapped_nll(model, "full", None, x, y)                              # (N, T)
    rows, counts = [], {}
    for w in windows:
        long_range = dist >= w                                                 # (N, T)
        counts[w] = int(long_range.sum())
        for kind in ("full", *SWAP_KINDS):
            losses = []
            for draw in range(sw["seeds"] if kind == "sa" else 1):
                model.seed_sa(draw)
                losses.append(full if kind == "full" else swapped_nll(model, kind, w, x, y))
            keys = visible_keys(kind, w, T).numpy()                            # (T,)
            groups = dict(long_range=long_range, local=~long_range, all=np.ones_like(long_range))
            rows.append(dict(attn=kind, window=w, **(moba_budget(w) if kind == "moba" else {}),
                             **{f"keys_{g}": float(keys[m.nonzero()[1]].mean()) if m.any() else None
                                for g, m in groups.items()},
                             **{f"loss_{g}": [float(nll[m].mean()) for nll in losses] if m.any() else None
                                for g, m in groups.items()}))
    common.save(f"swap{suffix}.json", dict(
        checkpoint=name, T=T, val_seqs=len(x), tokens=int(x.numel()), long_range_tokens=counts, context=CONTEXT,
        sa_draws=sw["seeds"], moba="moba_chunk = window // 4, moba_topk = 4", runs=rows,
        definition="long-range at w: the nearest earlier occurrence of the 8 bytes up to the query, followed by the "
                   "target byte, has that byte >= w tokens before the query (copy_distance); local: every other token",
        keys="mean visible keys per query, counted on the masks (visible_keys), over all queries and over each "
             "group's queries; SA and SWA see equally many over all queries at the same window"))

    p = common.plt()
    fig, axes = p.subplots(1, 2, figsize=(10, 3.8))
    for ax, part in zip(axes, ("long_range", "local")):
        for i, kind in enumerate(SWAP_KINDS):
            rs = [r for r in rows if r["attn"] == kind and r[f"loss_{part}"] is not None]
            ax.errorbar([r[f"keys_{part}"] for r in rs], [statistics.mean(excess(rows, r, f"loss_{part}")) for r in rs],
                        yerr=[statistics.pstdev(excess(rows, r, f"loss_{part}")) for r in rs], marker="o", capsize=3,
                        color=f"C{i}", label={"sink": "swa + sink"}.get(kind, kind))
        ax.axhline(0, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"mean visible keys of the {part.replace('_', '-')} tokens' queries")
        ax.set_ylabel(f"loss − full's, {part.replace('_', '-')} tokens (nats)")
        ax.set_title(f"{part.replace('_', '-')} tokens (windows {', '.join(map(str, windows))})", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"full-attention byte LM (T={T}), attention swapped, no training", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, f"swap{suffix}.png"), dpi=120)


def excess(rows, r, part):
    """Row r's losses on `part` minus full attention's on the same tokens (the full row of r's window)."""
    full = next(f for f in rows if (f["attn"], f["window"]) == ("full", r["window"]))
    return [a - full[part][0] for a in r[part]]


def swap_summary(doc):
    """swap.json's table: every kind and window, the loss on long-range, local and all tokens."""
    T, rows = doc["T"], doc["runs"]
    fmt = lambda r, part: "-" if r[part] is None else (  # noqa: E731
        mean_std(r[part]) + ("" if r["attn"] == "full" else f" ({statistics.mean(excess(rows, r, part)):+.3f})"))
    lines = [f"{doc['checkpoint']} (full attention, T={T}) swapped without training, {doc['val_seqs']} val sequences "
             f"({doc['tokens']:,} tokens); loss in nats per byte (in brackets: minus full's on the same tokens); keys: "
             "mean visible keys per query, over all queries / over the long-range tokens' queries:", "",
             "| w (w/T) | long-range tokens | attn | keys: all / long-range | loss, long-range tokens "
             "| loss, local tokens | loss, all tokens |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["window"]
        lines.append(f"| {w} (1/{T // w}) | {doc['long_range_tokens'][str(w)]:,} | {r['attn']} | {r['keys_all']:.1f} / "
                     + ("-" if r["keys_long_range"] is None else f"{r['keys_long_range']:.1f}")
                     + f" | {fmt(r, 'loss_long_range')} | {fmt(r, 'loss_local')} | {fmt(r, 'loss_all')} |")
    return "\n".join(lines)
