"""
Recall (Zoology's MQAR) in miniature: claim 2 (SWA fails beyond its reach) and claim 6(a) (a trained model's attention
swapped without training), beside what each kind's attention graph lets it retrieve. Steps of results/reproduce.py:
mqar_search (the recipe's learning rate), mqar (every kind at equal key budget, below coverage), recall_swap. The
helpers here (the recall data, retrievable, predictions) serve the pre-registered experiment (decisive.py) and the
demo (demo.py) too.
"""
import functools
import os
import statistics

import common
from common import evals, finished, mean_std, train_all

KINDS = ["full", "swa", "sa", "sa+swa", "moba"]


# Recall: prepare_data.prepare_mqar's layout (Zoology's MQAR), 64 tokens: 4 cue-value pairs
# from a vocabulary of 32 (15 cues, 16 values), then 4 queries at random positions of the second
# half, each asking a random pair, at least 25 tokens after it: the answer must be found by
# content (which earlier cue equals mine). Window 4 (SWA reaches 3 tokens per layer, 12 in 4
# layers), MoBA at the same key budget (2 chunks of 2), fresh training sequences every batch, a
# fixed val set.
MQAR_DATA = ["--mqar_seq_len=64", "--mqar_num_pairs=4", "--mqar_num_queries=4", "--mqar_vocab=32"]
# The recipe (config/mqar.py) and the search around it, full attention at depth 2. The grid
# trains with RECIPE; the learning rate decides whether the recall circuit forms at all.
RECIPE = dict(n_embd=64, n_head=1, learning_rate=1e-4, weight_decay=0.0, batch_size=32)
SEARCH = [dict(learning_rate=lr) for lr in (3e-4, 1e-3)]
# The grid's cells, named as --kinds names them: (attn, sa_draw, n_head). sa+swa-head gives each of
# 4 heads of 16 dimensions its own permutation (more shortcuts for the same key budget); full-4heads
# is its control. The rows of mqar.json and lm1024.json keep sa_draw's old name, sa_perm.
CELLS = {**{k: (k, "layer", RECIPE["n_head"]) for k in KINDS}, "sa+swa-head": ("sa+swa", "head", 4),
         "full-4heads": ("full", "layer", 4)}
PERM_DRAWS = (1, 4, 16)  # SA evaluated with its logits averaged over K draws of the permutations
# The grid's sizes, and --fast's (every code path, tiny)
SIZES = dict(iters=12000, seeds=[0, 1, 2], depths=[2, 4], T=64, window=4, swap_windows=[2, 4, 8, 16, 32, 64],
             swap_seeds=3, swap_seqs=300, data=["--mqar_val_seqs=1000"], train=[])
FAST = dict(iters=8, seeds=[0], depths=[2], T=64, window=4, swap_windows=[4, 64], swap_seeds=2, swap_seqs=20,
            data=["--mqar_train_seqs=64", "--mqar_val_seqs=100"], train=["--eval_iters=2"])


def sizes():
    return FAST if common.fast else SIZES


def mqar_data(name="data-recall", layout=MQAR_DATA):
    """data_root holding a recall dataset, prepared once (it is deterministic)."""
    data = os.path.join(common.work, name)
    if not os.path.exists(os.path.join(data, "mqar", "meta.json")):
        common.run("prepare_data.py", "--dataset=mqar", f"--data_root={data}", *layout, *sizes()["data"])
    return data


def search():
    """Full attention at depth 2 with each SEARCH setting (else RECIPE): val accuracy over training."""
    size, name = sizes(), lambda st: "-".join(f"{k}{v:g}" for k, v in st.items())  # noqa: E731
    runs = [(os.path.join(common.work, "mqar-search-" + name(st)), st) for st in SEARCH]
    train_all([(od, dict(presets=["config/mqar.py", *size["train"]], data_root=mqar_data(), attn="full", seed=0,
                         max_iters=size["iters"], eval_interval=max(1, size["iters"] // 10), **st))
               for od, st in runs])
    rows = [dict(setting=st, iters=size["iters"], val_acc=evals(od)[-1]["val_acc"], wall_s=evals(od)[-1]["elapsed_s"],
                 curve=[(r["iter"], r["val_acc"]) for r in evals(od)]) for od, st in runs]
    common.save("mqar_search.json", dict(data=MQAR_DATA, train=["config/mqar.py", *size["train"]], attn="full",
                                         n_layer=2, runs=rows, recipe=RECIPE))


def search_summary(doc):
    lines = ["| setting (else RECIPE) | iterations | val accuracy | wall time |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {' '.join(f'{k}={v:g}' for k, v in r['setting'].items())} | {r['iters']} "
                              f"| {r['val_acc']:.3f} | {r['wall_s']:.0f} s |" for r in doc["runs"]])


@functools.lru_cache
def recall_val(n, data=None):
    """The first n val sequences of the recall set in data_root `data` (None: mqar_data()) and their
    targets (-1 where unscored), (n, T) each; read once (every cell's prediction asks for them)."""
    import numpy as np

    from prepare_data import load_meta, load_tokens, mqar_targets
    path = os.path.join(data or mqar_data(), "mqar")
    meta = load_meta(path)
    x = np.asarray(load_tokens(path, "val", meta), np.int64).reshape(-1, meta["mqar"]["seq_len"])[:n]
    return x, mqar_targets(x, meta)


def recall_accuracy(model, x, y, draws=1):
    """Answer accuracy on the recall sequences x with targets y, both (N, T) tensors; SA's logits
    are averaged over `draws` fresh draws of its permutations (one draw for the other kinds)."""
    import torch
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 100):
            logits = sum(model(x[i:i + 100])[0] for _ in range(draws)) / draws                     # (b, T, V)
            scored = y[i:i + 100] != -1
            correct += (logits.argmax(-1)[scored] == y[i:i + 100][scored]).sum().item()
    return correct / (y != -1).sum().item()


def answers(x, y):
    """Every scored answer of recall sequences x with targets y, (N, T) each: (query, value) token
    positions, (A,) each: where the query stands and where the value it asks for stands."""
    import numpy as np
    row, query = np.nonzero(y != -1)                                           # (A,) each
    return query, (x[row] == y[row, query][:, None]).argmax(1)                 # (A,) each


def reachable(kind, sa_draw, n_head, depth, x, y, window, seeds=20):
    """Coverage: with receptive_field.py's exact graph (causal), the fraction of the (query,
    answer) pairs of x, y that `depth` layers connect by any path; mean over seeds of the
    permutations. Full attention connects all in one layer; MoBA's graph is chosen by content,
    and any past block can be chosen, so the graph allows it all (1.0): whether routing finds
    it is learned. A path counts even when its first hop carries a raw embedding, so this is
    not what content recall needs: retrievable() is."""
    import numpy as np

    import receptive_field as rf
    if kind in ("full", "moba"):
        return 1.0
    T = x.shape[1]
    query, answer = answers(x, y)                                              # (A,) each
    heads = n_head if sa_draw == "head" else 1  # sa_draw=head: a permutation per head, the graph their union
    fractions = []
    for s in range(1 if kind == "swa" else seeds):
        rng = np.random.default_rng(s)
        R = rf.identity_bits(T)                                                # (T, ceil(T/64)) bitsets
        for _ in range(depth):
            perms = [rng.permutation(T) for _ in range(heads)] if kind != "swa" else []
            R = rf.apply_layer(R, *rf.layer_graph(T, window, kind, "causal", perms), True)
        fractions.append(np.mean((R[query, answer >> 6] >> (answer & 63).astype(np.uint64)) & np.uint64(1)))
    return float(np.mean(fractions))


def retrievable(kind, sa_draw, n_head, depth, x, y, window, draws=200):
    """What content recall needs: the fraction of the (query, answer) pairs of x, y in which the
    query sees its answer's value token directly in some layer >= 2, with attention.py's own
    masks (sa_mask, swa_mask) and fresh permutations per layer (per head with sa_draw=head);
    mean over `draws` draws. The value token learns its cue (the binding) at layer 1, from its
    neighbour; a query can match that binding only by reading the value token afterwards. Full
    attention sees it at depth >= 2 (1.0); MoBA's router may pick any past chunk (1.0: whether
    it does is learned); SWA sees nothing farther than window - 1. A relay (the value token's
    binding copied onward at layer 2, read at layer 3) is not counted: a lower bound for L >= 3."""
    import numpy as np
    import torch

    import attention
    if depth < 2:
        return 0.0
    if kind in ("full", "moba"):
        return 1.0
    T = x.shape[1]
    q, a = map(torch.from_numpy, answers(x, y))                                # (A,) each
    local = attention.swa_mask(T, window)[q, a]                                # (A,) SWA's path, every layer
    if kind == "swa":
        return local.float().mean().item()
    heads = n_head if sa_draw == "head" else 1
    g = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(draws):
        perms = torch.stack([torch.randperm(T, generator=g) for _ in range((depth - 1) * heads)])  # (M, T)
        shortcut = attention.sa_mask(window, perms)[:, q, a].any(0)           # (A,) in some layer >= 2
        seen.append((shortcut | (local if kind == "sa+swa" else False)).float().mean().item())
    return float(np.mean(seen))


def retrievable_formula(T, window, depth, heads):
    """retrievable() in closed form for an answer farther back than window - 1: a uniform
    permutation puts two tokens fewer than w slots apart with p = (w - 1)(2T - w) / (T(T - 1)),
    and the (depth - 1) * heads draws are independent. Also the issue's approximation, with
    p ~ 2(w - 1)/(T - 1). Returns (exact, approximate)."""
    n = (depth - 1) * heads
    p = (window - 1) * (2 * T - window) / (T * (T - 1))
    return 1 - (1 - p) ** n, 1 - (1 - 2 * (window - 1) / (T - 1)) ** n


def predictions(kind, sa_draw, n_head, depth, x, y, window, pairs):
    """The graph's reach, the retrievable fraction r, and the accuracy ceiling r + (1 - r) / pairs:
    a model that misses the binding guesses among the sequence's values, or among all 16 values
    of the vocabulary where the graph reaches none of them (SWA)."""
    r = retrievable(kind, sa_draw, n_head, depth, x, y, window)
    reach = reachable(kind, sa_draw, n_head, depth, x, y, window)
    return dict(reachable=reach, retrievable=r, ceiling=r + (1 - r) / (pairs if reach > 0 else 16))


def mqar(seeds=3, depths="2", kinds="", train=True):
    """MQAR at equal budget: answer accuracy and val loss by cell, depth and seed, beside the graph's
    reach and the retrievable fraction. Trains (unless train is False) the first `seeds` seeds of the cells
    `kinds` (default: every cell at the first depth, full and sa+swa deeper) at `depths` (comma lists; "" = all).
    A run whose checkpoint is not here keeps its committed row."""
    size, data = sizes(), mqar_data()
    first = size["depths"][0]  # every cell trains at the first depth, the 4-head cells only there
    deeper = ("full", "sa+swa")  # by default, deeper only the claim's pair: the whole reproduction fits 3 hours
    grid = [(c, d, s) for d in size["depths"] for s in size["seeds"] for c in CELLS
            if c in KINDS or d == first]  # depth-major: the shallow grid trains first
    out_dir = lambda c, d, s: os.path.join(common.work, f"mqar-{c}-L{d}-s{s}")  # noqa: E731
    chosen = lambda c, d, s: (train and s in size["seeds"][:seeds]  # noqa: E731
                              and (not depths or str(d) in depths.split(","))
                              and (c in kinds.split(",") if kinds else d == first or c in deeper))
    train_all([(out_dir(c, d, s), dict(presets=["config/mqar.py", *size["train"]], data_root=data, attn=CELLS[c][0],
                                       sa_draw=CELLS[c][1], n_head=CELLS[c][2], n_layer=d, seed=s,
                                       max_iters=size["iters"], eval_interval=size["iters"] // 4))
               for c, d, s in grid if chosen(c, d, s)])
    old = common.committed("mqar.json") if not common.fast else {}
    kept = {(r["cell"], r["n_layer"], r["seed"]): r for r in old.get("runs", []) if old.get("iters") == size["iters"]}
    rows, fresh = [], []
    for c, d, s in grid:
        if finished(out_dir(c, d, s), size["iters"]):
            last = evals(out_dir(c, d, s))[-1]
            fresh.append(dict(cell=c, attn=CELLS[c][0], sa_perm=CELLS[c][1], n_head=CELLS[c][2], n_layer=d, seed=s,
                              val_acc=last["val_acc"], val_loss=last["val_loss"], wall_s=last["elapsed_s"]))
            rows.append(fresh[-1])
        elif (c, d, s) in kept:
            rows.append(kept[c, d, s])
    x, y = recall_val(300)
    predicted = {f"{c}/{d}": predictions(*CELLS[c], d, x, y, size["window"], 4) for c in CELLS for d in size["depths"]}
    averaged = permutation_average([r for r in fresh if r["attn"] in ("sa", "sa+swa")], out_dir)
    done = {(a["cell"], a["n_layer"], a["seed"]) for a in averaged}
    averaged += [a for a in old.get("permutation_average", []) if (a["cell"], a["n_layer"], a["seed"]) not in done
                 and (a["cell"], a["n_layer"], a["seed"]) in kept]
    common.save("mqar.json", dict(iters=size["iters"], data=MQAR_DATA, train=["config/mqar.py", *size["train"]],
                                  recipe=RECIPE, cells=CELLS, runs=rows, predicted=predicted,
                                  permutation_average=averaged))

    cell = lambda c, d: [r["val_acc"] for r in rows if (r["cell"], r["n_layer"]) == (c, d)]  # noqa: E731
    p = common.plt()
    fig, ax = p.subplots(figsize=(5.5, 3.6))
    for i, c in enumerate(CELLS):
        ds = [d for d in size["depths"] if cell(c, d)]
        accs = [cell(c, d) for d in ds]
        ax.errorbar(ds, [statistics.mean(a) for a in accs], yerr=[statistics.pstdev(a) for a in accs], marker="o",
                    color=f"C{i}", capsize=3, label=c, ls="-" if c in KINDS else "none")
        ax.plot(ds, [predicted[f"{c}/{d}"]["ceiling"] for d in ds], color=f"C{i}", ls=":", alpha=0.7)
    ax.set_xlabel("layers")
    ax.set_ylabel("MQAR answer accuracy (val)")
    ax.set_xticks(size["depths"])
    ax.set_title("solid: measured (mean ± std over seeds); dotted: ceiling r + (1 - r)/4", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "mqar.png"), dpi=120)


def grid_table(doc):
    """mqar.json's runs, a row per cell and depth, beside the graph's predictions."""
    rows, predicted = doc["runs"], doc["predicted"]
    cell = lambda c, d, field="val_acc": [r[field] for r in rows if (r["cell"], r["n_layer"]) == (c, d)]  # noqa: E731
    lines = ["| cell | layers | val accuracy (mean ± std over seeds) | val loss (nats) | seeds "
             "| reachable in the graph | retrievable r | ceiling |", "|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [
        f"| {c} | {d} | {mean_std(cell(c, d))} | {mean_std(cell(c, d, 'val_loss'))} | {len(cell(c, d))} | "
        + " | ".join(f"{predicted[f'{c}/{d}'][k]:.3f}" for k in ("reachable", "retrievable", "ceiling")) + " |"
        for d in sorted({r["n_layer"] for r in rows}) for c in doc["cells"] if cell(c, d)])


def average_table(doc):
    """SA's accuracy with its logits averaged over K draws of the permutations, per trained SA model."""
    averaged = doc["permutation_average"]
    lines = ["SA's logits averaged over K draws of the permutations (first 300 val sequences):", "",
             "| cell | layers | seeds | " + " | ".join(f"K={K}" for K in PERM_DRAWS) + " |",
             "|---|---|---|" + "---|" * len(PERM_DRAWS)]
    for c, d in dict.fromkeys((a["cell"], a["n_layer"]) for a in averaged):
        group = [a["accs"] for a in averaged if (a["cell"], a["n_layer"]) == (c, d)]
        means = " | ".join(mean_std([g[str(K)] for g in group]) for K in PERM_DRAWS)
        lines.append(f"| {c} | {d} | {len(group)} | {means} |")
    return "\n".join(lines)


def permutation_average(rows, out_dir):
    """How much of SA's error is sampling noise: each trained SA model's val accuracy with its logits
    averaged over K draws of the permutations (the first 300 val sequences, draws seeded 0)."""
    import torch

    from checkpoint import load_checkpoint
    x, y = map(torch.from_numpy, recall_val(300))                                                 # (N, T) each
    averaged = []
    for r in rows:
        model, _ = load_checkpoint(os.path.join(out_dir(r["cell"], r["n_layer"], r["seed"]), "ckpt.pt"))
        model.eval()
        accs = {}
        for K in PERM_DRAWS:
            model.seed_sa(0)
            accs[K] = recall_accuracy(model, x, y, draws=K)
        averaged.append(dict(cell=r["cell"], n_layer=r["n_layer"], seed=r["seed"], accs=accs))
    return averaged


def recall_swap():
    """Training-free, where long range matters: the full-attention MQAR model (2 layers, seed 0)
    evaluated on the val set with swa, sa (several permutation seeds) and moba at each window, no training."""
    import torch

    from checkpoint import load_checkpoint
    size = sizes()
    model, _ = load_checkpoint(os.path.join(common.work, f"mqar-full-L2-s{size['seeds'][0]}", "ckpt.pt"))
    model.eval()
    x, y = map(torch.from_numpy, recall_val(size["swap_seqs"]))                                   # (N, T) each

    def accuracy(**changes):
        model.swap_attention(**changes)
        return recall_accuracy(model, x, y)

    full = accuracy(attn="full")
    rows = []
    for w in size["swap_windows"]:
        rows.append(dict(attn="swa", window=w, accs=[accuracy(attn="swa", window=w)]))
        sa = []
        for s in range(size["swap_seeds"]):
            model.seed_sa(s)
            sa.append(accuracy(attn="sa", window=w))
        rows.append(dict(attn="sa", window=w, accs=sa))
        rows.append(dict(attn="moba", window=w, moba_chunk=max(1, w // 4), moba_topk=min(4, w),
                         accs=[accuracy(attn="moba", moba_chunk=max(1, w // 4), moba_topk=min(4, w))]))
    common.save("recall_swap.json", dict(checkpoint=f"mqar-full-L2-s{size['seeds'][0]}", val_seqs=len(x), full=full,
                                         runs=rows))

    p = common.plt()
    fig, ax = p.subplots(figsize=(5, 3.4))
    ax.axhline(full, color="k", ls="--", label="full (trained)")
    for kind in ("swa", "sa", "moba"):
        rs = [r for r in rows if r["attn"] == kind]
        ax.errorbar([r["window"] for r in rs], [statistics.mean(r["accs"]) for r in rs],
                    yerr=[statistics.pstdev(r["accs"]) for r in rs], marker="o", capsize=3, label=kind)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("window (MoBA: 4 chunks of window/4)")
    ax.set_ylabel("MQAR answer accuracy (val)")
    ax.set_title("full-attention model, attention swapped, no training", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "recall_swap.png"), dpi=120)


def recall_swap_summary(doc):
    ws = sorted({r["window"] for r in doc["runs"]})
    lines = [f"answer accuracy of the full-attention recall model (full: {doc['full']:.3f}), attention swapped, no "
             "training:", "", "| attn | " + " | ".join(f"w={w}" for w in ws) + " |", "|---|" + "---|" * len(ws)]
    for kind in ("swa", "sa", "moba"):
        lines.append(f"| {kind} | " + " | ".join(mean_std(r["accs"]) for r in doc["runs"] if r["attn"] == kind) + " |")
    return "\n".join(lines)
