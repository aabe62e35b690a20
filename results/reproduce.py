"""
Reproduce the paper in miniature on a CPU: every table and plot in the README's Results. Each experiment runs the
repo's own scripts as subprocesses, printing every command, and writes its JSON and plots into --out (default
results/); summary.md collects the tables that the README quotes.

    python results/reproduce.py                       # the paper's claims: about 3 h on 2 quiet cores (estimated)
    python results/reproduce.py --only=mqar --train=False # the MQAR tables from the finished (or committed) runs
    python results/reproduce.py --only=lm1024         # issues 33, 38: plain LM, far copying at T=1024 (~22 CPU-hours)
    python results/reproduce.py --fast=True           # a tiny version of everything, about 4 minutes (tested in CI)
    python results/reproduce.py --only=demo --out=out-demo  # the class demo: SWA, SA+SWA and full on recall
    python results/reproduce.py --only=mqar,lm        # some of: figure, lm, swap, mqar, mqar_decisive, recall_swap,
                                                      # coverage, speed, lm1024; mqar_search and sa_rules when named

The default run's time is estimated from measured steps (never run as one invocation): the depth-2 MQAR grid
about 1.6 h, mqar_decisive 1.3 h, lm 11 minutes, swap 7, coverage 6, the rest a few.
"""
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from prepare_data import pyplot  # noqa: E402 (the repo's modules, after the path)
from provenance import provenance, result_rows, stamp  # noqa: E402

# -----------------------------------------------------------------------------
fast = False            # tiny sizes everywhere: checks the pipeline, not the claims
only = ""               # comma list of experiments ("" = all)
out = os.path.join(ROOT, "results")  # JSON, PNG and summary.md go here
work = os.path.join(ROOT, "out-reproduce")  # data and checkpoints (not committed)
jobs = 2                # training runs in parallel, one thread each (2 cores: faster than 2 threads per run)
seeds = 3               # MQAR: train the first `seeds` seeds of each cell (a rerun with more keeps these)
depths = "2"            # MQAR: train these depths, comma list ("" = all: 2 and 4; depth 4 is not decidable with this recipe)
kinds = ""              # MQAR: train these cells (CELLS), comma list ("" = the default grid)
arms = ""               # mqar_decisive: train these arms, comma list of P ("" = both); tables report every finished run
swap_T = "256"          # swap: the LM contexts, comma list; 256 swaps lm's model, another T trains its own (swap_T<T>.json)
train = True            # mqar, lm1024: False builds their tables from the finished runs only
names = ""              # lm1024: train only these runs, comma list of run names in this order ("" = every run)
demo_seeds = "0"        # demo: train these seeds of each kind, comma list
# -----------------------------------------------------------------------------
exec(open(os.path.join(ROOT, "configurator.py")).read())

KINDS = ["full", "swa", "sa", "sa+swa", "moba"]
EXTRA = {"sa_rules", "mqar_search", "demo"}  # run when named in --only (and in --fast): the value rule is ours, not the
# paper's; the search's result is committed (mqar_search.json), and leaving it out keeps the default run near 3 hours
if fast:
    MQAR = dict(iters=8, seeds=[0], depths=[2], T=64, window=4, swap_windows=[4, 64], swap_seeds=2,
                swap_seqs=20, data=["--mqar_train_seqs=64", "--mqar_val_seqs=100"], train=["--eval_iters=2"])
    LM = dict(iters=6, seeds=[0], eval_interval=3, extra=dict(eval_iters=2))
    SWAP = dict(fractions=[32, 8], seeds=2, tokens=2048)
    COVER = ["--grid_n=256,1024", "--seeds=2"]
    SPEED = ["--sizes=256", "--kinds=full,swa,sa,moba", "--reps=1"]
    LM1024 = dict(T=64, window=4, wide=8, windows=[4, 8], seeds=[0], plain_iters=6, copy_iters=6, val_windows=4, copy_val=4,
                  swap_windows=[4, 8, 32], draws=2, path_draws=2, extra=dict(eval_interval=3, eval_iters=2),
                  long_iters=12, long_eval=6)
else:
    MQAR = dict(iters=12000, seeds=[0, 1, 2], depths=[2, 4], T=64, window=4,
                swap_windows=[2, 4, 8, 16, 32, 64], swap_seeds=3, swap_seqs=300, data=["--mqar_val_seqs=1000"],
                train=[])
    LM = dict(iters=500, seeds=[0, 1], eval_interval=50, extra={})
    SWAP = dict(fractions=[32, 16, 8, 4, 2], seeds=3, tokens=131072)  # windows T / fractions, tokens // T val sequences
    COVER = []
    SPEED = []
    LM1024 = dict(T=1024, window=32, wide=128, windows=[32, 64, 128], seeds=[0, 1, 2], plain_iters=4500, copy_iters=4000, val_windows=48,
                  copy_val=32, swap_windows=[16, 32, 64, 128, 256, 512], draws=3, path_draws=8,
                  extra=dict(eval_interval=250, eval_iters=16),
                  long_iters=12000, long_eval=500)  # issue 45: SA+SWA and SWA at c["wide"], 3x the copy task's iterations


def run(*args, threads=None):
    """Run one of the repo's scripts; returns its wall time in seconds."""
    print("$ python " + " ".join(args), flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.time()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t0


def train_all(runs):
    """train.py once per (out_dir, args), `jobs` at a time, one thread each. A run whose log
    already ends with its final eval is kept: rerunning the same seed would repeat it. An unfinished
    run continues from its checkpoint if that checkpoint is of these args (resuming is exact), else
    starts again."""
    def train(out_dir, args):
        args = {"lr_decay_iters": args["max_iters"], **args}  # the cosine over the run (train.py's default is its own)
        if finished(out_dir, args["max_iters"]):
            return
        run("train.py", *args["presets"], f"--out_dir={out_dir}", *(f"--{k}={v}" for k, v in args.items() if k != "presets"),
            "--init_from=resume" if resumable(out_dir, args) else "--overwrite=True", threads=1 if jobs > 1 else None)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda r: train(*r), runs))


def resumable(out_dir, args):
    """Whether out_dir holds a checkpoint whose settings have every one of args' values."""
    from checkpoint import load_checkpoint
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return False
    settings = load_checkpoint(path)[1]["settings"]
    return all(str(settings.get(k)) == str(v) for k, v in args.items() if k != "presets")


def wall_and_resumes(out_dir):
    """A train.py run's wall time in seconds over all its sessions, and the iterations it resumed at: a resumed run
    cuts its log back to its checkpoint's eval and logs on with elapsed_s counted from its own start."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        log = [json.loads(line) for line in f if line.strip()]
    drops = [i for i in range(1, len(log)) if log[i]["elapsed_s"] < log[i - 1]["elapsed_s"]]
    return dict(wall_s=round(sum(log[i - 1]["elapsed_s"] for i in drops) + log[-1]["elapsed_s"], 2),
                resumes=[log[i]["iter"] for i in drops])


def finished(out_dir, iters):
    return os.path.exists(os.path.join(out_dir, "log.jsonl")) and evals(out_dir)[-1]["iter"] == iters


def evals(out_dir):
    """The evaluation records of a train.py run's log.jsonl."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if "val_loss" in r]


def save(name, obj):
    """Writes out/NAME, each row with the commit and command it comes from (provenance.stamp)."""
    obj, known = json.loads(json.dumps(obj)), list(result_rows(committed(name)))
    for row in result_rows(obj):
        stamp(row, known)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1)


def mean_std(xs):
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def plt():
    try:
        return pyplot("results/reproduce.py's plots")
    except ValueError as e:
        sys.exit(str(e))


# -----------------------------------------------------------------------------

def figure():
    """The permutation picture: who sees whom under SWA, SA (in both orders) and SA+SWA."""
    import torch

    import attention
    T, w = 24, 3
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(3))
    panels = [("SWA (token order)", "token", attention.swa_mask(T, w)),
              ("SA in permuted order: a band,\ncausal on original positions", "slot", attention.swa_mask(T, w, pos=perm)),
              ("SA scattered back to token order", "token", attention.sa_mask(w, perm)),
              ("SA+SWA: local band + random shortcuts", "token", attention.swa_mask(T, w) | attention.sa_mask(w, perm))]
    p = plt()
    fig, axes = p.subplots(1, 4, figsize=(15, 4.3))
    for ax, (title, unit, mask) in zip(axes, panels):
        ax.imshow(mask.numpy(), cmap="Greys", vmin=0, vmax=1.3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"key {unit}")
        ax.set_ylabel(f"query {unit}")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"Which keys each query sees: T={T}, window={w}, one random permutation", y=0.99)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sa_picture.png"), dpi=80)
    return "sa_picture.png"


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


def mqar_data(name="data-recall", layout=MQAR_DATA):
    """data_root holding a recall dataset, prepared once (it is deterministic)."""
    data = os.path.join(work, name)
    if not os.path.exists(os.path.join(data, "mqar", "meta.json")):
        run("prepare_data.py", "--dataset=mqar", f"--data_root={data}", *layout, *MQAR["data"])
    return data


def mqar_search():
    """Full attention at depth 2 with each SEARCH setting (else RECIPE): val accuracy over training."""
    name = lambda st: "-".join(f"{k}{v:g}" for k, v in st.items())
    runs = [(os.path.join(work, "mqar-search-" + name(st)), st) for st in SEARCH]
    train_all([(od, dict(presets=["config/mqar.py", *MQAR["train"]], data_root=mqar_data(), attn="full", seed=0,
                         max_iters=MQAR["iters"], eval_interval=max(1, MQAR["iters"] // 10), **st))
               for od, st in runs])
    rows = [dict(setting=st, iters=MQAR["iters"], val_acc=evals(od)[-1]["val_acc"], wall_s=evals(od)[-1]["elapsed_s"],
                 curve=[(r["iter"], r["val_acc"]) for r in evals(od)]) for od, st in runs]
    save("mqar_search.json", dict(data=MQAR_DATA, train=["config/mqar.py", *MQAR["train"]], attn="full",
                                  n_layer=2, runs=rows, recipe=RECIPE))
    lines = ["| setting (else RECIPE) | iterations | val accuracy | wall time |", "|---|---|---|---|"]
    lines += [f"| {' '.join(f'{k}={v:g}' for k, v in r['setting'].items())} | {r['iters']} | {r['val_acc']:.3f} "
              f"| {r['wall_s']:.0f} s |" for r in rows]
    return "\n".join(lines)


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


def committed(name):
    """The committed results/NAME (the runs of a machine whose checkpoints are gone), or {}."""
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else {}


def predictions(kind, sa_draw, n_head, depth, x, y, window, pairs):
    """The graph's reach, the retrievable fraction r, and the accuracy ceiling r + (1 - r) / pairs:
    a model that misses the binding guesses among the sequence's values, or among all 16 values
    of the vocabulary where the graph reaches none of them (SWA)."""
    r = retrievable(kind, sa_draw, n_head, depth, x, y, window)
    reach = reachable(kind, sa_draw, n_head, depth, x, y, window)
    return dict(reachable=reach, retrievable=r, ceiling=r + (1 - r) / (pairs if reach > 0 else 16))


def mqar():
    """MQAR at equal budget: answer accuracy and val loss by cell, depth and seed, beside the graph's
    reach and the retrievable fraction. A run whose checkpoint is not here keeps its committed row."""
    data = mqar_data()
    first = MQAR["depths"][0]  # every cell trains at the first depth, the 4-head cells only there
    deeper = ("full", "sa+swa")  # by default, deeper only the claim's pair: the whole reproduction fits 3 hours
    grid = [(c, d, s) for d in MQAR["depths"] for s in MQAR["seeds"] for c in CELLS
            if c in KINDS or d == first]  # depth-major: the shallow grid trains first
    out_dir = lambda c, d, s: os.path.join(work, f"mqar-{c}-L{d}-s{s}")
    chosen = lambda c, d, s: (train and s in MQAR["seeds"][:seeds] and (not depths or str(d) in depths.split(","))
                              and (c in kinds.split(",") if kinds else d == first or c in deeper))
    train_all([(out_dir(c, d, s), dict(presets=["config/mqar.py", *MQAR["train"]], data_root=data, attn=CELLS[c][0],
                                       sa_draw=CELLS[c][1], n_head=CELLS[c][2], n_layer=d, seed=s,
                                       max_iters=MQAR["iters"], eval_interval=MQAR["iters"] // 4))
               for c, d, s in grid if chosen(c, d, s)])
    old = committed("mqar.json") if not fast else {}
    kept = {(r["cell"], r["n_layer"], r["seed"]): r for r in old.get("runs", []) if old.get("iters") == MQAR["iters"]}
    rows, fresh = [], []
    for c, d, s in grid:
        if finished(out_dir(c, d, s), MQAR["iters"]):
            last = evals(out_dir(c, d, s))[-1]
            fresh.append(dict(cell=c, attn=CELLS[c][0], sa_perm=CELLS[c][1], n_head=CELLS[c][2], n_layer=d, seed=s,
                              val_acc=last["val_acc"], val_loss=last["val_loss"], wall_s=last["elapsed_s"]))
            rows.append(fresh[-1])
        elif (c, d, s) in kept:
            rows.append(kept[c, d, s])
    x, y = recall_val(300)
    predicted = {f"{c}/{d}": predictions(*CELLS[c], d, x, y, MQAR["window"], 4) for c in CELLS for d in MQAR["depths"]}
    averaged = permutation_average([r for r in fresh if r["attn"] in ("sa", "sa+swa")], out_dir)
    done = {(a["cell"], a["n_layer"], a["seed"]) for a in averaged}
    averaged += [a for a in old.get("permutation_average", []) if (a["cell"], a["n_layer"], a["seed"]) not in done
                 and (a["cell"], a["n_layer"], a["seed"]) in kept]
    save("mqar.json", dict(iters=MQAR["iters"], data=MQAR_DATA, train=["config/mqar.py", *MQAR["train"]],
                           recipe=RECIPE, cells=CELLS, runs=rows, predicted=predicted,
                           permutation_average=averaged))

    cell = lambda c, d, field="val_acc": [r[field] for r in rows if (r["cell"], r["n_layer"]) == (c, d)]
    p = plt()
    fig, ax = p.subplots(figsize=(5.5, 3.6))
    for i, c in enumerate(CELLS):
        ds = [d for d in MQAR["depths"] if cell(c, d)]
        accs = [cell(c, d) for d in ds]
        ax.errorbar(ds, [statistics.mean(a) for a in accs], yerr=[statistics.pstdev(a) for a in accs], marker="o",
                    color=f"C{i}", capsize=3, label=c, ls="-" if c in KINDS else "none")
        ax.plot(ds, [predicted[f"{c}/{d}"]["ceiling"] for d in ds], color=f"C{i}", ls=":", alpha=0.7)
    ax.set_xlabel("layers")
    ax.set_ylabel("MQAR answer accuracy (val)")
    ax.set_xticks(MQAR["depths"])
    ax.set_title("solid: measured (mean ± std over seeds); dotted: ceiling r + (1 - r)/4", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mqar.png"), dpi=120)

    lines = ["| cell | layers | val accuracy (mean ± std over seeds) | val loss (nats) | seeds | reachable in the graph "
             "| retrievable r | ceiling r + (1 − r)/4 |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {c} | {d} | {mean_std(cell(c, d))} | {mean_std(cell(c, d, 'val_loss'))} | {len(cell(c, d))} | "
              + " | ".join(f"{predicted[f'{c}/{d}'][k]:.3f}" for k in ("reachable", "retrievable", "ceiling")) + " |"
              for d in MQAR["depths"] for c in CELLS if cell(c, d)]
    lines += ["", "SA's logits averaged over K draws of the permutations (first 300 val sequences):", "",
              "| cell | layers | seeds | " + " | ".join(f"K={K}" for K in PERM_DRAWS) + " |",
              "|---|---|---|" + "---|" * len(PERM_DRAWS)]
    for c, d in dict.fromkeys((a["cell"], a["n_layer"]) for a in averaged):
        group = [{str(K): v for K, v in a["accs"].items()} for a in averaged if (a["cell"], a["n_layer"]) == (c, d)]
        lines.append(f"| {c} | {d} | {len(group)} | " + " | ".join(mean_std([g[str(K)] for g in group]) for K in PERM_DRAWS)
                     + " |")
    return "\n".join(lines)


# The pre-registered experiment (issue 22), at the depth where SA can work: 3 layers, window 8, 4
# heads of 16 dimensions, each with its own permutation (sa_draw=head; receptive_field.py: every
# pair connected in 2 layers at n=64), MoBA at the same key budget (4 chunks of 2). The pairs start
# at token 1, so no MoBA chunk holds a whole (cue, value) pair. Arm P=1: one pair, one query (a
# pure long-range broadcast: any path carries the value); arm P=4: content recall. Every cell trains
# with Zoology's optimiser settings (lr 3e-4, warmup, cosine to 0, beta2 0.999, weight decay 0.01, no
# clipping): config/mqar.py's depth-2 recipe left full attention on the plateau at depth 3 (mqar_probes.json).
DECISIVE = dict(n_layer=3, window=8, n_head=4, sa_draw="head", moba_chunk=2, moba_topk=4, learning_rate=3e-4,
                decay_lr=True, warmup_iters=200, min_lr=0.0, beta2=0.999, weight_decay=0.01, grad_clip=0.0)
ARMS = {1: dict(iters=3000, cells={"full": 1, "swa": 1, "sa+swa": 2}, confirm=0.9, refute=0.5,
                data=["--mqar_seq_len=64", "--mqar_num_pairs=1", "--mqar_num_queries=1", "--mqar_vocab=32",
                      "--mqar_offset=1"]),
        4: dict(iters=12000, cells={"full": 3, "sa+swa": 3, "swa": 1, "moba": 1}, confirm=0.75, refute=0.35,
                data=["--mqar_seq_len=64", "--mqar_num_pairs=4", "--mqar_num_queries=4", "--mqar_vocab=32",
                      "--mqar_offset=1"])}
if fast:  # one seed of two cells per arm: every code path, few runs
    ARMS = {P: dict(a, iters=8, cells=dict.fromkeys(cells, 1)) for (P, a), cells in
            zip(ARMS.items(), [("full", "sa+swa"), ("sa+swa", "moba")])}


def arm_verdict(P, accs):
    """The pre-registered rule, literally. Valid only if every full seed >= 0.95 and SWA <= 0.10.
    SA+SWA confirms at >= ARMS[P]["confirm"] in every seed, refutes at <= ARMS[P]["refute"] in
    every seed; anything between is partial. MoBA is beside the rule, not in it: its run may be missing.
    A finished SA+SWA seed between the thresholds decides "partial": no other seed can change that."""
    a, sa = ARMS[P], accs.get("sa+swa", [])
    between = any(a["refute"] < x < a["confirm"] for x in sa)
    missing = [f"{c} {len(accs.get(c, []))} of {n}" for c, n in a["cells"].items()
               if len(accs.get(c, [])) < n and c != "moba" and not (c == "sa+swa" and between)]
    if missing:
        return "not decidable (not run: " + ", ".join(missing) + " seeds finished)"
    full, swa = accs.get("full", []), accs.get("swa", [])
    if not full or not swa:  # --fast trains only two cells per arm
        return "not decidable: no full-attention or SWA run"
    if min(full) < 0.95:
        return f"not decidable: full attention {min(full):.3f} < 0.95 in a seed"
    if max(swa) > 0.10:
        return f"not decidable: SWA {max(swa):.3f} > 0.10"
    if len(sa) < a["cells"]["sa+swa"]:
        return f"partial ({len(sa)} of {a['cells']['sa+swa']} SA+SWA seeds finished, one between the thresholds)"
    return "refutes" if max(sa) <= a["refute"] else "confirms" if min(sa) >= a["confirm"] else "partial"


def mqar_decisive():
    """Both arms of the pre-registered experiment: accuracy and val loss per cell and seed, the
    predictions beside them, and the verdict by the rule (arm_verdict)."""
    rows, verdicts, predicted = [], {}, {}
    for P, a in ARMS.items():
        data = mqar_data(f"data-recall-P{P}", a["data"])
        out_dir = lambda c, s: os.path.join(work, f"decisive-P{P}-{c}-L{DECISIVE['n_layer']}-s{s}")
        runs = [(c, s) for c, n in a["cells"].items() for s in range(n)]
        if not arms or str(P) in arms.split(","):
            train_all([(out_dir(c, s), dict(presets=["config/mqar.py", *MQAR["train"]], data_root=data, attn=c, seed=s,
                                            max_iters=a["iters"], eval_interval=a["iters"] // 4, **DECISIVE))
                       for c, s in runs])
        for c, s in runs:
            if finished(out_dir(c, s), a["iters"]):
                log = evals(out_dir(c, s))
                rows.append(dict(P=P, cell=c, seed=s, iters=a["iters"], val_acc=log[-1]["val_acc"],
                                 val_loss=log[-1]["val_loss"], wall_s=log[-1]["elapsed_s"],
                                 curve=[(r["iter"], r["val_acc"]) for r in log]))
        x, y = recall_val(300, data)
        for c in a["cells"]:
            predicted[f"P{P}/{c}"] = predictions(c, DECISIVE["sa_draw"], DECISIVE["n_head"], DECISIVE["n_layer"], x, y,
                                                 DECISIVE["window"], P)
        verdicts[P] = arm_verdict(P, {c: [r["val_acc"] for r in rows if (r["P"], r["cell"]) == (P, c)] for c in a["cells"]})
    v = list(verdicts.values())
    overall = ("refuted" if "refutes" in v else "confirmed" if v == ["confirms"] * len(v)
               else "not decidable" if any(x.startswith("not") for x in v) else "partial")
    save("mqar_decisive.json", dict(setup=DECISIVE, arms={P: {k: x for k, x in a.items()} for P, a in ARMS.items()},
                                    train=["config/mqar.py", *MQAR["train"]], runs=rows, predicted=predicted,
                                    verdicts=verdicts, overall=overall))
    p = plt()
    fig, axes = p.subplots(1, len(ARMS), figsize=(7, 3.2), sharey=True)
    for ax, (P, a) in zip(axes, ARMS.items()):
        for i, c in enumerate(a["cells"]):
            accs = [r["val_acc"] for r in rows if (r["P"], r["cell"]) == (P, c)]
            ax.scatter([i] * len(accs), accs, color=f"C{i}", zorder=3)
            ax.plot([i - 0.3, i + 0.3], [predicted[f"P{P}/{c}"]["ceiling"]] * 2, color="k", ls=":")
        ax.axhline(a["confirm"], color="g", lw=0.8)
        ax.axhline(a["refute"], color="r", lw=0.8)
        ax.set_xticks(range(len(a["cells"])), list(a["cells"]), fontsize=8)
        ax.set_title(f"P={P}, {a['iters']} iterations: {verdicts[P].split(' (')[0].split(':')[0]}", fontsize=8)
    axes[0].set_ylabel("val answer accuracy (dots: seeds)")
    fig.suptitle("pre-registered, 3 layers: green confirm, red refute, dotted the ceiling r + (1 - r)/P", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mqar_decisive.png"), dpi=120)
    lines = ["| arm | cell | iterations | val accuracy per seed | mean ± std | val loss (nats) | reachable in the graph "
             "| retrievable r | ceiling r + (1 − r)/P |", "|---|---|---|---|---|---|---|---|---|"]
    for P, a in ARMS.items():
        for c in a["cells"]:
            rs = [r for r in rows if (r["P"], r["cell"]) == (P, c)]
            pr = predicted[f"P{P}/{c}"]
            lines.append(f"| P={P} | {c} | {a['iters']} | " + (", ".join(f"{r['val_acc']:.3f}" for r in rs) or "not run")
                         + f" | {mean_std([r['val_acc'] for r in rs]) if rs else '-'} | "
                         + f"{mean_std([r['val_loss'] for r in rs]) if rs else '-'} | "
                         + " | ".join(f"{pr[k]:.3f}" for k in ("reachable", "retrievable", "ceiling")) + " |")
    lines += [""] + [f"- arm P={P}: **{v}**" for P, v in verdicts.items()] + [f"- overall: **{overall}**"]
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
    model, _ = load_checkpoint(os.path.join(work, f"mqar-full-L2-s{MQAR['seeds'][0]}", "ckpt.pt"))
    model.eval()
    x, y = map(torch.from_numpy, recall_val(MQAR["swap_seqs"]))                                   # (N, T) each

    def accuracy(**changes):
        model.swap_attention(**changes)
        return recall_accuracy(model, x, y)

    full = accuracy(attn="full")
    rows = []
    for w in MQAR["swap_windows"]:
        rows.append(dict(attn="swa", window=w, accs=[accuracy(attn="swa", window=w)]))
        sa = []
        for s in range(MQAR["swap_seeds"]):
            model.seed_sa(s)
            sa.append(accuracy(attn="sa", window=w))
        rows.append(dict(attn="sa", window=w, accs=sa))
        rows.append(dict(attn="moba", window=w, moba_chunk=max(1, w // 4), moba_topk=min(4, w),
                         accs=[accuracy(attn="moba", moba_chunk=max(1, w // 4), moba_topk=min(4, w))]))
    save("recall_swap.json", dict(checkpoint=f"mqar-full-L2-s{MQAR['seeds'][0]}", val_seqs=len(x), full=full,
                                  runs=rows))

    p = plt()
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
    fig.savefig(os.path.join(out, "recall_swap.png"), dpi=120)

    ws = MQAR["swap_windows"]
    lines = [f"answer accuracy of the full-attention recall model (full: {full:.3f}), attention swapped, no training:",
             "", "| attn | " + " | ".join(f"w={w}" for w in ws) + " |", "|---|" + "---|" * len(ws)]
    for kind in ("swa", "sa", "moba"):
        lines.append(f"| {kind} | " + " | ".join(mean_std(r["accs"]) for r in rows if r["attn"] == kind) + " |")
    return "\n".join(lines)


def lm():
    """Byte-level language modelling on pystdlib: config/quick.py for each kind and seed."""
    data = os.path.join(work, "data")
    run("prepare_data.py", "--dataset=pystdlib", f"--data_root={data}")
    rows, curves = [], {}
    runs = [(kind, seed) for kind in KINDS[:4] for seed in LM["seeds"]]
    dirs = [os.path.join(work, f"lm-{kind}-s{seed}") for kind, seed in runs]
    train_all([(od, dict(presets=["config/quick.py"], data_root=data, attn=kind, seed=seed, max_iters=LM["iters"],
                         eval_interval=LM["eval_interval"], **LM["extra"]))
               for (kind, seed), od in zip(runs, dirs)])
    for (kind, seed), od in zip(runs, dirs):
        log = evals(od)
        curves[f"{kind}/{seed}"] = [(r["iter"], r["val_loss"]) for r in log]
        rows.append(dict(attn=kind, seed=seed, val_loss=log[-1]["val_loss"],
                         val_bpb=log[-1]["val_loss"] / math.log(2), wall_s=log[-1]["elapsed_s"]))
    save("lm.json", dict(iters=LM["iters"], config="config/quick.py", runs=rows, curves=curves))

    p = plt()
    fig, ax = p.subplots(figsize=(5.5, 3.6))
    for i, kind in enumerate(KINDS[:4]):
        for seed in LM["seeds"]:
            pts = curves[f"{kind}/{seed}"][1:]
            ax.plot(*zip(*pts), color=f"C{i}", alpha=1 if seed == LM["seeds"][0] else 0.5,
                    label=kind if seed == LM["seeds"][0] else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("val loss (nats per byte)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lm.png"), dpi=120)

    lines = ["| attn | val loss | val bits per byte | wall time per run |", "|---|---|---|---|"]
    for kind in KINDS[:4]:
        rs = [r for r in rows if r["attn"] == kind]
        lines.append(f"| {kind} | {mean_std([r['val_loss'] for r in rs])} | {mean_std([r['val_bpb'] for r in rs])} "
                     f"| {statistics.mean(r['wall_s'] for r in rs):.0f} s |")
    return "\n".join(lines)


# The rules' recall comparison ran on the ordered layout (every answer 63 tokens back) with the recipe
# config/mqar.py had then; pinned here, so that the step reruns what results/README.md quotes.
RULES_RECALL_DATA = ["--mqar_seq_len=128", "--mqar_num_pairs=32", "--mqar_num_queries=32", "--mqar_vocab=256",
                     "--mqar_ordered=True"]
RULES_RECALL = dict(block_size=128, n_head=2, n_embd=128, window=8, moba_chunk=2, moba_topk=4, learning_rate=3e-3,
                    decay_lr=True, warmup_iters=50, min_lr=3e-4, n_layer=2)


def sa_rules():
    """SA's two rules (attention.py's docstring), rank (the paper's) and value (decodable from a KV
    cache), at the same budget and seeds: the lm step's LM runs, and recall on the ordered layout
    (RULES_RECALL), for sa and sa+swa. Trained afresh, each rank run next to its value twin (at the
    same time with jobs=2), so that their wall times share the machine's load."""
    lm_data, recall_data = os.path.join(work, "data"), os.path.join(work, "data-ordered")
    run("prepare_data.py", "--dataset=pystdlib", f"--data_root={lm_data}")
    run("prepare_data.py", "--dataset=mqar", f"--data_root={recall_data}", *RULES_RECALL_DATA, *MQAR["data"])
    recall_iters = 8 if fast else 300
    setups = dict(lm=dict(presets=["config/quick.py"], data_root=lm_data, max_iters=LM["iters"],
                          eval_interval=LM["eval_interval"], **LM["extra"]),
                  recall=dict(presets=["config/mqar.py", *MQAR["train"]], data_root=recall_data, **RULES_RECALL,
                              max_iters=recall_iters, eval_interval=recall_iters // 4))
    rules, sa_kinds = ["rank", "value"], ["sa", "sa+swa"]
    runs = [(t, k, r, s) for t in setups for s in LM["seeds"] for k in sa_kinds for r in rules]  # LM first
    dirs = [os.path.join(work, f"rules-{t}-{k}-{r}-s{s}") for t, k, r, s in runs]
    train_all([(od, dict(setups[t], attn=k, sa_rule=r, seed=s)) for (t, k, r, s), od in zip(runs, dirs)])
    rows = []
    for (task, kind, rule, seed), od in zip(runs, dirs):
        last = evals(od)[-1]
        rows.append(dict(task=task, attn=kind, sa_rule=rule, seed=seed, val_loss=last["val_loss"],
                         **({"val_acc": last["val_acc"]} if task == "recall" else {}),
                         wall_s=last["elapsed_s"]))
    save("sa_rules.json", dict(setups={t: {k: v for k, v in a.items() if k != "data_root"} for t, a in setups.items()},
                               recall_data=RULES_RECALL_DATA, runs=rows))

    metric = dict(lm="val_loss", recall="val_acc")
    cell = lambda t, k, r, field: [x[field] for x in rows if (x["task"], x["attn"], x["sa_rule"]) == (t, k, r)]
    lines = ["| task: metric | attn | rank | value | value − rank | seeds | wall time per run: rank, value |",
             "|---|---|---|---|---|---|---|"]
    for t in setups:
        for k in sa_kinds:
            rank, value = (cell(t, k, r, metric[t]) for r in rules)
            lines.append(f"| {t}: {metric[t]} | {k} | {mean_std(rank)} | {mean_std(value)} "
                         f"| {statistics.mean(value) - statistics.mean(rank):+.3f} | {len(rank)} "
                         f"| {statistics.mean(cell(t, k, 'rank', 'wall_s')):.0f} s, "
                         f"{statistics.mean(cell(t, k, 'value', 'wall_s')):.0f} s |")
    return "\n".join(lines)


# The LM swap (issue 22, section 4): the full-attention byte LM that lm trained, its attention swapped
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
    Applied by swapped_nll in place of swa's function in model.KINDS, so attention.py stays as it is."""
    import attention
    return attention.masked_attention(q, k, v, sink_mask(q.shape[2], window, q.device))


def lm_val(n, T):
    """n sequences of T + 1 bytes spread evenly over the LM's val split: inputs and targets, (n, T) each."""
    import numpy as np
    import torch

    from prepare_data import load_meta, load_tokens
    path = os.path.join(work, "data", "pystdlib")
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

    import model as M
    model.swap_attention(attn="swa" if kind == "sink" else kind,
                         **({} if kind == "full" else dict(window=window, **moba_budget(window))))
    sink = unittest.mock.patch.dict(M.KINDS, swa=M.KINDS["swa"]._replace(fn=sink_attention))
    with sink if kind == "sink" else contextlib.nullcontext():
        return nll(model, x, y, batch)


def nll(model, x, y, batch=16):
    """The model's loss on each prediction of x -> y, (N, T) numpy."""
    import torch
    import torch.nn.functional as F
    with torch.no_grad():
        return torch.cat([F.cross_entropy(model(x[i:i + batch])[0].transpose(1, 2), y[i:i + batch], reduction="none")
                          for i in range(0, len(x), batch)]).numpy()           # (N, T)


def swap():
    """The LM swap at each context length of swap_T (swap_at): one table each."""
    return "\n\n".join(swap_at(int(T)) for T in str(swap_T).split(","))


def swap_at(T):
    """Training-free, the paper's protocol in miniature: the full-attention byte LM from lm (4 layers, 4
    heads, T=256; another T trains its own, config/quick.py at that block_size) evaluated with swa,
    swa + sink, sa (SWAP["seeds"] permutation draws) and moba at windows w = T / SWAP["fractions"], on
    SWAP["tokens"] // T val sequences. The loss is split by copy_distance into long-range and local tokens
    at each window; each kind's keys are measured (visible_keys), over all queries and over the
    long-range tokens' queries, and the plot compares the kinds at equal measured keys."""
    import numpy as np

    from checkpoint import load_checkpoint
    seed, suffix = LM["seeds"][0], "" if T == 256 else f"_T{T}"
    name = f"lm-full-s{seed}" if T == 256 else f"lm-full-T{T}-s{seed}"
    if T != 256:
        data = os.path.join(work, "data")
        run("prepare_data.py", "--dataset=pystdlib", f"--data_root={data}")
        train_all([(os.path.join(work, name), dict(presets=["config/quick.py"], data_root=data, attn="full", seed=seed,
                                                   block_size=T, max_iters=LM["iters"],
                                                   eval_interval=LM["eval_interval"]))])
    model, _ = load_checkpoint(os.path.join(work, name, "ckpt.pt"))
    model.eval()
    windows = [T // f for f in SWAP["fractions"]]
    x, y = lm_val(SWAP["tokens"] // T, T)                                      # (N, T) each
    dist = copy_distance(x.numpy(), y.numpy())                                 # (N, T)
    full = swapped_nll(model, "full", None, x, y)                              # (N, T)
    rows, counts = [], {}
    for w in windows:
        long_range = dist >= w                                                 # (N, T)
        counts[w] = int(long_range.sum())
        for kind in ("full", *SWAP_KINDS):
            losses = []
            for draw in range(SWAP["seeds"] if kind == "sa" else 1):
                model.seed_sa(draw)
                losses.append(full if kind == "full" else swapped_nll(model, kind, w, x, y))
            keys = visible_keys(kind, w, T).numpy()                            # (T,)
            groups = dict(long_range=long_range, local=~long_range, all=np.ones_like(long_range))
            rows.append(dict(attn=kind, window=w, **(moba_budget(w) if kind == "moba" else {}),
                             **{f"keys_{g}": float(keys[m.nonzero()[1]].mean()) if m.any() else None
                                for g, m in groups.items()},
                             **{f"loss_{g}": [float(nll[m].mean()) for nll in losses] if m.any() else None
                                for g, m in groups.items()}))
    save(f"swap{suffix}.json", dict(
        checkpoint=name, T=T, val_seqs=len(x), tokens=int(x.numel()), long_range_tokens=counts, context=CONTEXT,
        sa_draws=SWAP["seeds"], moba="moba_chunk = window // 4, moba_topk = 4", runs=rows,
        definition="long-range at w: the nearest earlier occurrence of the 8 bytes up to the query, followed by the "
                   "target byte, has that byte >= w tokens before the query (copy_distance); local: every other token",
        keys="mean visible keys per query, counted on the masks (visible_keys), over all queries and over each "
             "group's queries; SA and SWA see equally many over all queries at the same window"))

    full_rows = {r["window"]: r for r in rows if r["attn"] == "full"}
    excess = lambda r, part: [a - full_rows[r["window"]][part][0] for a in r[part]]  # minus full's on the same tokens
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(10, 3.8))
    for ax, part in zip(axes, ("long_range", "local")):
        for i, kind in enumerate(SWAP_KINDS):
            rs = [r for r in rows if r["attn"] == kind and r[f"loss_{part}"] is not None]
            ax.errorbar([r[f"keys_{part}"] for r in rs], [statistics.mean(excess(r, f"loss_{part}")) for r in rs],
                        yerr=[statistics.pstdev(excess(r, f"loss_{part}")) for r in rs], marker="o", capsize=3,
                        color=f"C{i}", label={"sink": "swa + sink"}.get(kind, kind))
        ax.axhline(0, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"mean visible keys of the {part.replace('_', '-')} tokens' queries")
        ax.set_ylabel(f"loss − full's, {part.replace('_', '-')} tokens (nats)")
        ax.set_title(f"{part.replace('_', '-')} tokens (windows {', '.join(map(str, windows))})", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"full-attention byte LM (T={T}), attention swapped, no training", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"swap{suffix}.png"), dpi=120)

    fmt = lambda r, part: "-" if r[part] is None else (
        mean_std(r[part]) + ("" if r["attn"] == "full" else f" ({statistics.mean(excess(r, part)):+.3f})"))
    lines = [f"{name} (full attention, T={T}) swapped without training, {len(x)} val sequences ({x.numel():,} "
             f"tokens); loss in nats per byte (in brackets: minus full's on the same tokens); keys: mean visible "
             f"keys per query, over all queries / over the long-range tokens' queries:", "",
             "| w (w/T) | long-range tokens | attn | keys: all / long-range | loss, long-range tokens "
             "| loss, local tokens | loss, all tokens |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["window"]
        lines.append(f"| {w} (1/{T // w}) | {counts[w]:,} | {r['attn']} | {r['keys_all']:.1f} / "
                     + ("-" if r["keys_long_range"] is None else f"{r['keys_long_range']:.1f}")
                     + f" | {fmt(r, 'loss_long_range')} | {fmt(r, 'loss_local')} | {fmt(r, 'loss_all')} |")
    return "\n".join(lines)


# lm1024 (issue 33; its rule is pre-registered in results/README.md §2): a plain byte LM at T=1024, and far
# copying of real text, where every target of a sequence's second half repeats the byte T/2 back.


def lm1024_runs(data):
    """{name: (out_dir, train.py args)} in training order: issue 33's copy task seed by seed, its plain LM and its
    runs beside the rule; then issue 38's windows (c["windows"], every one past the first) and its per-layer arm;
    then issue 45's long runs at c["wide"], c["long_iters"] iterations with the cosine over them, named -i<iters>.
    Full attention reads no window: its runs at c["window"] serve every window (full_window_check)."""
    c, w = LM1024, LM1024["window"]
    cells = [("copy", kind, w, s) for s in c["seeds"] for kind in ("full", "sa+swa", "swa")]
    cells += [("plain", kind, w, s) for s in c["seeds"] for kind in ("full", "swa")]
    cells += [("copy", "sa+swa", c["wide"], s) for s in c["seeds"]] + [("copy", "moba", w, c["seeds"][0])]
    cells += [("copy", kind, wi, s) for wi in c["windows"][1:] for s in c["seeds"] for kind in ("swa", "sa+swa")]
    cells += [("copy", "sa+swa", c["wide"], c["seeds"][0], "layer")]
    cells += [("copy", kind, c["wide"], s, "head", c["long_iters"]) for s in c["seeds"] for kind in ("sa+swa", "swa")]
    runs = {}
    for task, kind, window, seed, perm, iters in ((*cell, *(None, None)[len(cell) - 4:]) for cell in cells):
        name = f"{task}-{kind}-w{window}-s{seed}" + (f"-{perm}" if perm and perm != "head" else "") \
            + (f"-i{iters}" if iters else "")  # a repeated cell (issue 33's w=128 arm) keeps its first place
        long = dict(max_iters=iters, lr_decay_iters=iters, eval_interval=c["long_eval"]) if iters else {}
        runs.setdefault(name, (os.path.join(work, "lm1024", name), dict(
            presets=["config/quick.py"], data_root=data, attn=kind, window=window, **moba_budget(window),
            sa_draw=perm or "head", block_size=c["T"], batch_size=2, seed=seed,
            copy_task=task == "copy",
            **{"max_iters": c[f"{task}_iters"], **c["extra"], **long})))
    return runs


def lm1024_cell(name):
    """A run name's task, attn, window, seed, sa_draw and iterations (None: the task's own):
    copy-sa+swa-w128-s0-layer -> copy, sa+swa, 128, 0, layer, None; copy-swa-w128-s1-i12000 -> ..., head, 12000."""
    task, kind, window, seed, *rest = name.split("-")
    iters = int(rest.pop()[1:]) if rest and rest[-1].startswith("i") else None
    return task, kind, int(window[1:]), int(seed[1:]), (rest or ["head"])[0], iters


def copy_verdict(rows, seeds):
    """The pre-registered rule on the copy runs {(kind, seed): (first-half loss, second-half loss)} of one window
    (full attention's from any window): (verdict, R per seed)."""
    if any((kind, s) not in rows for kind in ("full", "swa", "sa+swa") for s in seeds):
        return "not decidable (not run)", []
    if not all(rows["full", s][1] <= 0.3 and rows["swa", s][1] >= 0.9 * rows["swa", s][0] for s in seeds):
        return "not decidable (full attention does not copy, or SWA does)", []
    R = [(rows["swa", s][1] - rows["sa+swa", s][1]) / (rows["swa", s][1] - rows["full", s][1]) for s in seeds]
    if all(r >= 0.5 for r in R) and all(abs(rows["sa+swa", s][0] - rows["swa", s][0]) <= 0.02 for s in seeds):
        return "confirms", R
    return ("refutes" if all(r <= 0.1 for r in R) else "partial"), R


def copy_r_prime(rows, seeds):
    """R' (issue 38's secondary measure, no verdict): R on D = second - first half of each run, per seed."""
    if any((kind, s) not in rows for kind in ("full", "swa", "sa+swa") for s in seeds):
        return []
    D = {run: second - first for run, (first, second) in rows.items()}
    return [(D["swa", s] - D["sa+swa", s]) / (D["swa", s] - D["full", s]) for s in seeds]


def copy_reading(verdict, R, R_prime):
    """Issue 38's pre-registered wording where the rule says partial only through its L1 clause (R >= 0.5 in every
    seed) while R' >= 0.5 in every seed; else None: R' carries no verdict of its own."""
    if verdict == "partial" and min(R) >= 0.5 and min(R_prime) >= 0.5:
        return "copies, at a cost in local modelling"
    return None


def cost_reading(v, seeds):
    """": " and v's pre-registered reading, naming the seeds that pay its cost in local modelling (SA+SWA's first half
    above SWA's by more than the rule's 0.02), or "" where v has no reading."""
    if not v.get("reading"):
        return ""
    paying = [str(s) for s, gap in zip(seeds, v["first_gap"]) if gap > 0.02]
    who = "every seed" if len(paying) == len(seeds) else \
        f"seed{'s' * (len(paying) > 1)} {' and '.join(paying)} only" if paying else "no seed"
    return f": {v['reading']} (a cost in {who})"


def long_answer(sa_first, sa_copied, swa_first, gain):
    """Issue 45's pre-registered answer for one seed: SA+SWA's halves at 12,000, SWA's first half, and the copy
    advantage's gain over the same seed's committed 4,000-iteration runs."""
    if sa_copied <= 0.1 and abs(sa_first - swa_first) <= 0.02:
        return "closes"
    return "does not close" if gain < 0.05 or sa_copied > 0.2 else "narrows"


def long_verdict(rows, long_rows):
    """Issue 45, from the 12,000-iteration runs (long_rows) and the committed 4,000-iteration ones (rows): the rule
    at 12,000 (full attention's 4,000-iteration runs as L2(full)), the question per seed and over all, and the same
    quantities at iterations 4,000 and 8,000 of the long runs (another schedule: no verdict). A seed counts once both
    its arms reach 12,000; with some seeds missing, their numbers are reported, and neither verdict is drawn."""
    c = LM1024
    ends = {(r["attn"], r["seed"]): r["curve"][-1][0] for r in long_rows}
    seeds_ = [s for s in c["seeds"] if all(ends.get((k, s)) == c["long_iters"] for k in ("sa+swa", "swa"))]
    if not seeds_:
        return dict(verdict="not decidable (not run)" if not ends else f"not decidable (runs end at iterations "
                    f"{sorted(set(ends.values()))}, not {c['long_iters']:,})")
    missing = "" if seeds_ == c["seeds"] else f"not decidable (seed {', '.join(map(str, seeds_))} of " \
        f"{', '.join(map(str, c['seeds']))} finished)"
    w = long_rows[0]["window"]
    full = {s: next(r for r in rows if (r["task"], r["attn"], r["seed"], r["window"]) == ("copy", "full", s,
                                                                                         c["window"])) for s in seeds_}
    short = {(k, s): next(r for r in rows if (r["task"], r["attn"], r["seed"], r["window"], r.get("sa_perm", "head"))
                          == ("copy", k, s, w, "head")) for k in ("sa+swa", "swa") for s in seeds_}
    at = {}
    for it in sorted({4000, 8000, c["long_iters"]} & {p[0] for p in long_rows[0]["curve"]}):
        halves = {("full", s): (full[s]["first"], full[s]["second"]) for s in seeds_}
        for r in long_rows:
            point = next((p for p in r["curve"] if p[0] == it), None)
            if point and r["seed"] in seeds_:
                halves[r["attn"], r["seed"]] = tuple(point[1:])
        verdict, R = copy_verdict(halves, seeds_)
        adv = [halves["swa", s][1] - halves["sa+swa", s][1] for s in seeds_]
        at[it] = dict(verdict=missing or verdict, R=R, R_prime=copy_r_prime(halves, seeds_), advantage=adv,
                      copied=[halves["sa+swa", s][1] for s in seeds_], first=[halves["sa+swa", s][0] for s in seeds_],
                      swa_first=[halves["swa", s][0] for s in seeds_],
                      first_gap=[halves["sa+swa", s][0] - halves["swa", s][0] for s in seeds_])
        if not missing and (reading := copy_reading(verdict, R, at[it]["R_prime"])):
            at[it]["reading"] = reading
    end = at[c["long_iters"]]
    adv4k = [short["swa", s]["second"] - short["sa+swa", s]["second"] for s in seeds_]
    answers = [long_answer(f, cp, sf, a - a4) for f, cp, sf, a, a4 in zip(end["first"], end["copied"], end["swa_first"],
                                                                           end["advantage"], adv4k)]
    overall = missing or (answers[0] if len(set(answers)) == 1 and answers[0] != "narrows" else "narrows")
    return dict(window=w, iters=c["long_iters"], seeds=seeds_, advantage_4k_committed=adv4k, answers=answers,
                answer=overall, at=at, **{k: end[k] for k in ("verdict", "R", "R_prime", "first_gap")},
                reading=end.get("reading"))


def long_lines(v, rows, long_rows):
    """summary.md's issue-45 tables: the question, the rule at 12,000, and iterations 4,000 and 8,000 beside it; SWA's
    halves from its 4,000- to its 12,000-iteration runs, and full attention's copied half to 4 places (issue 56)."""
    if "answers" not in v:
        return ["", f"12,000-iteration runs (issue 45): {v['verdict']}"]
    f = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = ["", f"SA+SWA and SWA at w = {v['window']} for {v['iters']:,} iterations (issue 45; the cosine over "
             f"{v['iters']:,}), full attention's 4,000-iteration runs as L2(full); per seed "
             + ", ".join(map(str, v["seeds"])), "",
             "| iteration of the long runs | SA+SWA copied half | SA+SWA first half | SWA copied half | SWA first half | "
             "copy advantage (SWA's copied - SA+SWA's) | R | R' | verdict by the rule |",
             "|---|---|---|---|---|---|---|---|---|"]
    for it, a in v["at"].items():
        swa_copied = [x + y for x, y in zip(a["copied"], a["advantage"])]
        lines.append(f"| {it:,} | {f(a['copied'])} | {f(a['first'])} | {f(swa_copied)} | {f(a['swa_first'])} | "
                     f"{f(a['advantage'])} | "
                     f"{', '.join(f'{x:.2f}' for x in a['R'])} | {', '.join(f'{x:.2f}' for x in a['R_prime'])} | "
                     f"{a['verdict']}{cost_reading(a, v['seeds'])} |")
    gains = [a - b for a, b in zip(v["at"][v["iters"]]["advantage"], v["advantage_4k_committed"])]
    lines += ["", f"copy advantage of the committed 4,000-iteration runs: {f(v['advantage_4k_committed'])}; at "
              f"{v['iters']:,}: {f(v['at'][v['iters']]['advantage'])}; gain {', '.join(f'{g:+.3f}' for g in gains)}",
              f"SA+SWA's first half minus SWA's at {v['iters']:,}: {', '.join(f'{g:+.3f}' for g in v['first_gap'])}",
              f"the question, per seed: {', '.join(v['answers'])}; over all seeds: **{v['answer']}**",
              f"the rule at {v['iters']:,}: **{v['verdict']}**{cost_reading(v, v['seeds'])}"]
    run = {(r["attn"], r["window"], r["seed"], r["iters"]): r for r in rows + long_rows
           if r["task"] == "copy" and r.get("sa_perm", "head") == "head"}
    swa = [(run["swa", v["window"], s, v["iters"]], run["swa", v["window"], s, LM1024["copy_iters"]])
           for s in v["seeds"]]
    full = [run["full", LM1024["window"], s, LM1024["copy_iters"]]["second"] for s in v["seeds"]]
    return lines + [f"SWA's copied / first half, {v['iters']:,} minus its 4,000-iteration runs: " + ", ".join(
        f"{b['second'] - a['second']:+.3f} / {b['first'] - a['first']:+.3f}" for b, a in swa),
        f"full attention's copied half (L2(full)): {', '.join(f'{x:.4f}' for x in full)}; SA+SWA's at "
        f"{v['iters']:,} is {', '.join(f'{c / x:.0f}' for c, x in zip(v['at'][v['iters']]['copied'], full))} times it"]


def long_plot(p, rows, long_rows, T):
    """lm1024_long.png: the copied half over training, 12,000-iteration runs (solid) beside the committed
    4,000-iteration ones (dashed) and full attention's (black), per seed."""
    fig, axes = p.subplots(1, len(LM1024["seeds"]), figsize=(11, 3.4), sharey=True, squeeze=False)
    axes, w = axes[0], long_rows[0]["window"]
    for ax, s in zip(axes, LM1024["seeds"]):
        for kind, color in (("sa+swa", "C4"), ("swa", "C0")):
            for r, ls, what in ([r for r in long_rows if (r["attn"], r["seed"]) == (kind, s)], "-", "12,000"), (
                    [r for r in rows if (r["task"], r["attn"], r["seed"], r["window"], r.get("sa_perm", "head")) ==
                     ("copy", kind, s, w, "head")], "--", "4,000"):
                for row in r:
                    it, _, second = zip(*row["curve"])
                    ax.plot(it, second, color=color, ls=ls, lw=1, label=f"{kind}, {what} iterations")
        for row in [r for r in rows if (r["task"], r["attn"], r["seed"]) == ("copy", "full", s)][:1]:
            it, _, second = zip(*row["curve"])
            ax.plot(it, second, color="k", lw=1, label="full, 4,000 iterations")
        ax.set(xlabel="iteration", title=f"seed {s}, w = {w} (w/T = 1/{T // w})")
        ax.title.set_fontsize(9)
    axes[0].set_ylabel("val loss on the copied half (nats per byte)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lm1024_long.png"), dpi=120)


def swap_verdict(sa, swa):
    """Claim 6(b)'s pre-registered rule on the second-half losses {window: loss} of SA and SWA."""
    below = [sa[w] < swa[w] for w in swa]
    if all(b for w, b in zip(swa, below) if w < LM1024["T"] // 2):
        return "confirms"
    return "refutes" if not any(below) else "partial"


def ngram_hashes(tokens, n):
    """A 64-bit hash of every n-gram of a uint64 array: (..., L - n + 1); collisions are negligible here."""
    import numpy as np
    L = tokens.shape[-1] - n + 1
    h = np.zeros((*tokens.shape[:-1], L), np.uint64)
    for i in range(n):
        h = h * np.uint64(1000003) + tokens[..., i:L + i]
    return h


def unseen_in_train(x, y, n=CONTEXT + 1):
    """(N, T) bool: the n bytes that end in query t's target, x[t-n+2..t] and y[t], never occur in the
    train split (where they do, a model can know the byte without reading its earlier copy)."""
    import numpy as np

    from prepare_data import load_meta, load_tokens
    path = os.path.join(work, "data", "pystdlib")
    seen = np.unique(ngram_hashes(np.asarray(load_tokens(path, "train", load_meta(path)), np.uint64), n))
    rows = np.concatenate([x, y[:, -1:]], 1).astype(np.uint64)                # (N, T + 1)
    unseen = np.zeros(x.shape, bool)
    unseen[:, n - 2:] = ~np.isin(ngram_hashes(rows, n), seen)                  # the first n - 2 queries: too short
    return unseen


def copy_val(n, T):
    """n copy sequences from the val split (a random T/2-byte passage twice, seeded): inputs and targets,
    (n, T) each; the last target is a placeholder (the halves never score it)."""
    import numpy as np
    import torch

    from prepare_data import load_meta, load_tokens
    path = os.path.join(work, "data", "pystdlib")
    tokens = load_tokens(path, "val", load_meta(path))
    starts = np.random.default_rng(0).integers(0, len(tokens) - T // 2, n)
    passage = np.stack([np.asarray(tokens[s:s + T // 2], np.int64) for s in starts])  # (n, T/2)
    x = torch.from_numpy(np.concatenate([passage, passage], 1))                       # (n, T)
    return x, torch.cat([x[:, 1:], x[:, :1]], 1)                                     # (n, T)


def source_in_window(window, T, draws=64):
    """The chance that a second-half query's source byte (T/2 back) lies in its SA window, on the masks."""
    import torch

    import attention
    g, t = torch.Generator().manual_seed(0), torch.arange(T // 2 - 1, T - 1)
    return sum(attention.sa_mask(window, torch.randperm(T, generator=g))[t, t + 1 - T // 2].float().mean().item()
               for _ in range(draws)) / draws


def sources_in_window(perms, window, T):
    """(..., T/2) bool for perms (..., T): whether each copied-half query's source, the key T/2 - 1 back that holds
    the byte it predicts, lies in the query's SA window (the rank rule: slots fewer than `window` apart)."""
    import torch
    slot = torch.argsort(perms, dim=-1)                                        # (..., T): each token's slot
    t = torch.arange(T // 2 - 1, T - 1)                                        # the copied half's queries
    return (slot[..., t] - slot[..., t + 1 - T // 2]).abs() < window


def copy_paths(model, x, y, draws=8):
    """What carries the copy (issue 38's pre-registered measure) in an SA+SWA copy model, on the copy sequences
    x, y (n, T) at `draws` fixed draws (seed_sa(0..draws-1)): each copied-half query is DIRECT where its source
    is in its SA window in some layer and head, else OTHER; their losses, the same per layer, the masks'
    prediction for random permutations, and the per-layer SA and SWA gates; and the pre-registered reading."""
    import torch
    import torch.nn.functional as F
    c, (n, T) = model.config, x.shape
    L, heads, half = c.n_layer, c.n_head if c.sa_draw == "head" else 1, slice(T // 2 - 1, T - 1)
    gates = []
    hooks = [b.attn.gate.register_forward_hook(lambda m, i, o: gates.append(torch.sigmoid(o[:, half].float())))
             for b in model.transformer.h]                                     # (n, T/2, 2 * nh) per layer
    loss, first, inside, g = [], [], [], []
    with torch.no_grad():
        for d in range(draws):
            model.seed_sa(d)
            perms = model.draw_sa(n, T, x.device)                              # per layer: (T,) or (n, nh, T)
            gates.clear()
            nll = F.cross_entropy(model(x, draws=perms)[0].transpose(1, 2), y, reduction="none")  # (n, T)
            loss.append(nll[:, half])
            first.append(nll[:, :T // 2 - 1].mean())
            inside.append(torch.stack([sources_in_window(p.expand(n, heads, T), c.window, T).any(1)
                                       for p in perms], 1))                   # (n, L, T/2): in layer l's window
            g.append(torch.stack(gates, 1).unflatten(-1, (2, c.n_head)).mean(-1))  # (n, L, T/2, 2): sa, swa
    for h in hooks:
        h.remove()
    loss, inside, g = torch.stack(loss), torch.stack(inside), torch.stack(g)   # (D, n, T/2), (D, n, L, T/2), ...
    direct = inside.any(2)                                                     # (D, n, T/2)
    perms = torch.rand(64, L * heads, T, generator=torch.Generator().manual_seed(0)).argsort(-1)  # random ones
    predicted = sources_in_window(perms, c.window, T).view(64, L, heads, -1).any(2)  # (64, L, T/2)
    mean = lambda t, m: float(t[m].mean()) if m.any() else None  # noqa: E731
    L1, L2 = float(torch.stack(first).mean()), float(loss.mean())
    out = dict(draws=draws, sequences=n, first=L1, second=L2, direct=float(direct.float().mean()),
               direct_predicted=float(predicted.any(1).float().mean()), loss_direct=mean(loss, direct),
               loss_other=mean(loss, ~direct),
               layers=[dict(inside=float(inside[:, :, l].float().mean()), predicted=float(predicted[:, l].float().mean()),
                            loss_inside=mean(loss, inside[:, :, l]), loss_outside=mean(loss, ~inside[:, :, l]),
                            gate_sa=float(g[:, :, l, :, 0].mean()), gate_swa=float(g[:, :, l, :, 1].mean()),
                            gate_sa_inside=mean(g[:, :, l, :, 0], inside[:, :, l]),
                            gate_sa_outside=mean(g[:, :, l, :, 0], ~inside[:, :, l])) for l in range(L)])
    out["reading"] = path_reading(L1, L2, out["loss_direct"], out["loss_other"])
    used = [l for l in range(L) if out["layers"][l]["gate_sa"] >= USED_GATE]    # issue 45: the layers a model uses
    direct_used = inside[:, :, used].any(2)                                    # (D, n, T/2)
    out.update(used_layers=[l + 1 for l in used], loss_direct_used=mean(loss, direct_used),
               loss_other_used=mean(loss, ~direct_used))
    return out


USED_GATE = 0.1  # a layer is used by SA if its mean SA gate on copied-half queries is at least this (issue 45)


def path_reading(L1, L2, loss_direct, loss_other):
    """The pre-registered reading of a direct/other split: G(part) = first half - the part's copied-half loss."""
    gain = lambda part: L1 - part if part is not None else 0.0  # noqa: E731
    if L1 - L2 < 0.1:
        return "does not copy"
    if gain(loss_other) <= 0.1 * gain(loss_direct):
        return "the shortcuts carry it directly"
    return "relays carry it too" if gain(loss_other) >= 0.5 * gain(loss_direct) else "mixed"


def used_split(q):
    """The split on the used layers (USED_GATE): (used layers, loss direct, loss other, reading), from copy_paths'
    own split, else exact from the per-layer one where at most one layer is used; None where it needs the model."""
    used = [i + 1 for i, layer in enumerate(q["layers"]) if layer["gate_sa"] >= USED_GATE]
    if "loss_direct_used" in q:
        d, o = q["loss_direct_used"], q["loss_other_used"]
    elif len(used) == 1:
        d, o = q["layers"][used[0] - 1]["loss_inside"], q["layers"][used[0] - 1]["loss_outside"]
    elif not used:  # no query is direct
        d, o = None, q["second"]
    else:
        return None
    return used, d, o, path_reading(q["first"], q["second"], d, o)


def copy_paths_plot(p, paths, T):
    """lm1024_paths.png: each SA+SWA copy model's copied-half loss on direct and on other queries, beside its first
    half, against the window; and its SA gate by layer."""
    fig, axes = p.subplots(1, 2, figsize=(10, 3.6))
    windows = sorted({q["window"] for q in paths.values()})
    for q in paths.values():
        layer = q["sa_perm"] == "layer"
        for field, color, label in (("first", "0.6", "first half"), ("loss_other", "C0", "copied half, other"),
                                    ("loss_direct", "C3", "copied half, direct")):
            if q[field] is not None:
                axes[0].scatter(q["window"] * (1.1 if layer else 1), q[field], color=color,
                                marker="s" if layer else "o", s=14, label=label)
        axes[1].plot(range(1, len(q["layers"]) + 1), [x["gate_sa"] for x in q["layers"]], marker=".", alpha=0.7,
                     color=f"C{windows.index(q['window'])}", ls="-." if layer else "-",
                     label=f"w={q['window']}" + ", one permutation per layer" * layer)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(windows, [str(w) for w in windows])
    axes[0].set_xlabel("window w (squares: one permutation per layer)")
    axes[0].set_ylabel("loss (nats per byte)")
    axes[0].set_title(f"what carries the copy (T={T}): source in an SA window or not", fontsize=9)
    axes[1].set_xticks(range(1, len(q["layers"]) + 1))
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("mean SA gate, copied-half queries")
    for ax in axes:
        once = {}
        for handle, label in zip(*ax.get_legend_handles_labels()):
            once.setdefault(label, handle)                                     # each label once, its first marker
        ax.legend(once.values(), once.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lm1024_paths.png"), dpi=120)


def full_window_check(data, iters=None):
    """Whether full attention's copy runs serve every window: the first iterations of full attention at the
    smallest and the widest window, same seed, log the same training losses."""
    c = LM1024
    iters = iters or (3 if fast else 20)
    losses = {}
    for w in (c["window"], c["windows"][-1]):
        out_dir = os.path.join(work, "lm1024", f"full-window-check-w{w}")
        run("train.py", "config/quick.py", f"--out_dir={out_dir}", f"--data_root={data}", "--attn=full",
            f"--window={w}", f"--block_size={c['T']}", "--batch_size=2", f"--seed={c['seeds'][0]}", "--copy_task=True",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={iters}", "--eval_iters=1",
            "--log_interval=1", "--overwrite=True",
            threads=1)
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            losses[w] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    a, b = losses.values()
    return dict(windows=list(losses), iters=iters, identical=a == b, losses=a)


def lm1024():
    """Trains the runs of lm1024_runs (unless --train=False), then builds lm1024.json, lm1024.png and the
    tables from every finished run: the plain LM's val loss split by copy distance, the copy task's
    halves and verdict, and the training-free swap of the full-attention copy model (first seed)."""
    import numpy as np

    from checkpoint import load_checkpoint
    c, T, w0 = LM1024, LM1024["T"], LM1024["window"]
    data = os.path.join(work, "data")
    run("prepare_data.py", "--dataset=pystdlib", f"--data_root={data}")
    runs = lm1024_runs(data)
    if unknown := [n for n in names.split(",") if n and n not in runs]:
        sys.exit(f"--names: unknown run(s) {unknown}; the runs are {list(runs)}")
    if train:
        train_all([runs[n] for n in names.split(",")] if names else list(runs.values()))
    done = {n: od for n, (od, args) in runs.items()
            if os.path.exists(os.path.join(od, "log.jsonl")) and finished(od, args["max_iters"])}

    x, y = lm_val(c["val_windows"], T)                                         # (N, T) each
    dist = copy_distance(x.numpy(), y.numpy())                                 # (N, T)
    reach = 4 * (w0 - 1)  # SWA's reach at config/quick.py's 4 layers
    parts = dict(all=np.ones(x.shape, bool), far=dist >= reach, near=(dist >= 0) & (dist < reach))
    parts["far_unseen"] = parts["far"] & unseen_in_train(x.numpy(), y.numpy())
    # a run finished here is read from its log; one finished on a machine whose checkpoints are gone keeps its
    # committed row (committed: True)
    old = {r["name"]: r for part in ("runs", "long_runs") for r in committed("lm1024.json").get(part, [])}
    rows, long_rows = [], []  # issue 45's runs (-i<iters>) kept apart, so that the rule above reads only its own runs
    for name, r in old.items():
        if name not in done:
            (long_rows if lm1024_cell(name)[5] else rows).append(dict(r, committed=True))
    for name, od in done.items():
        task, kind, window, seed, sa_draw, long = lm1024_cell(name)
        log = evals(od)
        row = dict(name=name, task=task, attn=kind, window=window, seed=seed, sa_perm=sa_draw, n_layer=4, T=T,
                   iters=log[-1]["iter"], val_loss=log[-1]["val_loss"], **wall_and_resumes(od))
        if task == "copy":
            row.update(first=log[-1]["val_first"], second=log[-1]["val_second"],
                       curve=[(r["iter"], r["val_first"], r["val_second"]) for r in log])
        else:
            loss = nll(load_checkpoint(os.path.join(od, "ckpt.pt"))[0].eval(), x, y)  # (N, T)
            row.update(split={p: float(loss[m].mean()) if m.any() else None for p, m in parts.items()},
                       curve=[(r["iter"], r["val_loss"]) for r in log])
        if old.get(name, {}).get("committed"):  # retrained where its checkpoint was lost: it should log the same
            same = [list(p) for p in row["curve"]] == [list(p) for p in old[name]["curve"]]  # evals; if not, the
            row = row if same else dict(old[name], committed=True,  # committed numbers stay (pre-registered), the
                                        retrain=stamp(row, [old[name].get("retrain", {})]))  # retrain beside them
            row["reproduces_committed"] = same
        (long_rows if long else rows).append(row)
    rows.sort(key=lambda r: list(runs).index(r["name"]) if r["name"] in runs else len(runs))
    xc, yc = copy_val(c["copy_val"], T)                                        # (n, T) each: one set for all
    paths = committed("lm1024.json").get("copy_paths", {})  # what carries the copy, per SA+SWA copy model
    for name, od in done.items():
        task, kind, window, seed, sa_draw, long = lm1024_cell(name)
        if (task, kind) == ("copy", "sa+swa") and not long:
            model = load_checkpoint(os.path.join(od, "ckpt.pt"))[0].eval()
            paths[name] = dict(window=window, seed=seed, sa_perm=sa_draw, **copy_paths(model, xc, yc, c["path_draws"]))
    verdicts = {}  # the rule per window; full attention's runs at w0 serve every window
    for w in c["windows"]:
        halves = {(r["attn"], r["seed"]): (r["first"], r["second"]) for r in rows if r["task"] == "copy"
                  and r.get("sa_perm", "head") == "head" and (r["window"] == w or (r["attn"], r["window"]) == ("full", w0))}
        verdict, R = copy_verdict(halves, c["seeds"])
        verdicts[w] = dict(verdict=verdict, R=R, R_prime=copy_r_prime(halves, c["seeds"]), first_gap=[
            halves["sa+swa", s][0] - halves["swa", s][0] for s in c["seeds"] if ("sa+swa", s) in halves
            and ("swa", s) in halves])  # the rule's L1 clause: SA+SWA's first half minus SWA's, per seed
        if reading := copy_reading(verdict, R, verdicts[w]["R_prime"]):
            verdicts[w]["reading"] = reading
    verdict, R = verdicts[w0]["verdict"], verdicts[w0]["R"]

    swaps, swap_v, source, unswapped = [], "not decidable (not run)", f"copy-full-w{w0}-s{c['seeds'][0]}", None
    if source in done:
        model = load_checkpoint(os.path.join(done[source], "ckpt.pt"))[0].eval()
        second = slice(T // 2 - 1, T - 1)
        unswapped = float(nll(model, xc, yc)[:, second].mean())
        for w in c["swap_windows"]:
            for kind in SWAP_KINDS:
                losses = []
                for draw in range(c["draws"] if kind == "sa" else 1):
                    model.seed_sa(draw)
                    losses.append(float(swapped_nll(model, kind, w, xc, yc)[:, second].mean()))
                swaps.append(dict(attn=kind, window=w, second=losses,
                                  keys=float(visible_keys(kind, w, T)[second].mean()),
                                  **({"source_in_window": source_in_window(w, T)} if kind == "sa" else {})))
        mean = lambda kind: {r["window"]: statistics.mean(r["second"]) for r in swaps if r["attn"] == kind}
        swap_v = swap_verdict(mean("sa"), mean("swa"))
    elif committed("lm1024.json").get("swap_source") == source:  # its checkpoint is gone: keep the committed swap
        old = committed("lm1024.json")
        swaps, swap_v, unswapped = old["swap"], old["swap_verdict"], old["swap_full"]
    check = full_window_check(data) if train or "full_window_check" not in committed("lm1024.json") else \
        committed("lm1024.json")["full_window_check"]
    save("lm1024.json", dict(setup={k: v for k, v in c.items()}, reach=reach, context=CONTEXT,
                             split_tokens={p: int(m.sum()) for p, m in parts.items()}, runs=rows,
                             copy_verdict=verdict, R=R, verdicts=verdicts, full_window_check=check,
                             copy_paths=dict(sorted(paths.items(), key=lambda kv: (kv[1]["window"], kv[0]))),
                             swap_source=source, swap_full=unswapped, swap=swaps,
                             swap_verdict=swap_v, long_runs=long_rows, long_verdict=long_verdict(rows, long_rows),
                             halves="first: targets 0..T/2-2 (plain LM); second: targets T/2-1..T-2 (copies)"))

    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(10, 3.8))
    cell = lambda r: (r["attn"], r["window"], r.get("sa_perm", "head"))  # noqa: E731
    cells = sorted({cell(r) for r in rows if r["task"] == "copy"}, key=lambda k: (k[1], k[0], k[2]))
    color = {"swa": "C0", "sink": "C1", "sa": "C2", "moba": "C3", "full": "k", "sa+swa": "C4"}  # both panels alike
    style = dict(zip(c["windows"], ["-", "--", ":"]))
    for kind, w, perm in cells:
        for r in [r for r in rows if r["task"] == "copy" and cell(r) == (kind, w, perm)]:
            it, _, second = zip(*r["curve"])
            axes[0].plot(it, second, color=color[kind], ls="-." if perm == "layer" else style.get(w, "-"), lw=1,
                         alpha=1 if r["seed"] == c["seeds"][0] else 0.5,
                         label=(f"{kind}, w={w}{', per layer' * (perm == 'layer')}" if kind != "full" else "full (any w)")
                         if r["seed"] == c["seeds"][0] else None)
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("val loss on the copied half (nats per byte)")
    axes[0].set_title(f"trained on the copy task (T={T}, source {T // 2} back)", fontsize=9)
    for kind in SWAP_KINDS:
        rs = [r for r in swaps if r["attn"] == kind]
        axes[1].plot([r["window"] for r in rs], [statistics.mean(r["second"]) for r in rs], marker="o",
                     color=color[kind], label={"sink": "swa + sink"}.get(kind, kind))
    if unswapped is not None:
        axes[1].axhline(unswapped, color=color["full"], ls="--", lw=0.8, label="full (unswapped)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("window w")
    axes[1].set_ylabel("loss on the copied half (nats per byte)")
    axes[1].set_title(f"{source}, attention swapped, no training", fontsize=9)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lm1024.png"), dpi=120)
    if paths:
        copy_paths_plot(p, paths, T)
    if long_rows:
        long_plot(p, rows, long_rows, T)

    by = lambda task, kind, w: [r for r in rows if (r["task"], r["attn"], r["window"]) == (task, kind, w)]
    lines = [f"Plain LM (T={T}, {c['plain_iters']} iterations): val loss on {len(x)} windows, split by copy "
             f"distance (far: >= {reach}, SWA's reach)", "",
             "| attn | seeds | val loss | all | far copies | far, 9-gram unseen in train | near copies |",
             "|---|---|---|---|---|---|---|"]
    for kind in ("full", "swa"):
        rs = by("plain", kind, w0)
        if rs:
            lines.append(f"| {kind} | {len(rs)} | {mean_std([r['val_loss'] for r in rs])} | "
                         + " | ".join("-" if rs[0]["split"][p] is None else mean_std([r["split"][p] for r in rs])
                                      for p in ("all", "far", "far_unseen", "near"))
                         + " |")
    full, swa = by("plain", "full", w0), by("plain", "swa", w0)
    if full and [r["seed"] for r in full] == [r["seed"] for r in swa]:  # per seed, exact: the text quotes these
        lines.append("| full − swa, per seed | | | " + " | ".join(
            ", ".join("-" if f["split"][p] is None else f"{f['split'][p] - s['split'][p]:+.4f}" for f, s in zip(full, swa))
            for p in ("all", "far", "far_unseen", "near")) + " |")
    lines += ["", f"tokens: {', '.join(f'{p} {int(m.sum()):,}' for p, m in parts.items())}", "",
              f"Copy task (T={T}, {c['copy_iters']} iterations): val loss on the first half / the copied half, per seed "
              f"(each seed's own val sequences); full attention's runs at w = {w0} serve every window", "",
              "| attn | window (w/T) | seeds | first half | copied half | copied − first |", "|---|---|---|---|---|---|"]
    for kind, w, perm in cells:
        rs = [r for r in rows if r["task"] == "copy" and cell(r) == (kind, w, perm)]
        lines.append(f"| {kind}{' (one permutation per layer)' * (perm == 'layer')} | {w} (1/{T // w}) | "
                     + ", ".join(str(r["seed"]) for r in rs) + " | "
                     + " | ".join(", ".join(f"{r[h]:.3f}" for r in rs) for h in ("first", "second")) + " | "
                     + ", ".join(f"{r['second'] - r['first']:+.3f}" for r in rs) + " |")
    lines += ["", "SA+SWA's copied − first half minus SWA's, per seed, over training (negative: SA+SWA copies more):", "",
              "| window | seed | " + " | ".join(str(i) for i in range(0, c["copy_iters"] + 1, c["copy_iters"] // 4)) + " |",
              "|---|---|" + "---|" * 5]
    for w in c["windows"]:
        for s_ in c["seeds"]:
            pair = [next((r for r in rows if r["task"] == "copy" and cell(r) == (kind, w, "head") and r["seed"] == s_),
                         None) for kind in ("sa+swa", "swa")]
            if all(pair):
                gap = {it: second - first for it, first, second in pair[0]["curve"]}
                gap = {it: g - (second - first) for it, first, second in pair[1]["curve"] if (g := gap.get(it)) is not None}
                lines.append(f"| {w} | {s_} | " + " | ".join(f"{gap[i]:+.3f}" if i in gap else "-"
                                                            for i in range(0, c["copy_iters"] + 1, c["copy_iters"] // 4)) + " |")
    lines += ["", "| window (w/T) | verdict (claim 5's mechanism) | R per seed | R' per seed | SA+SWA's first half − SWA's "
              "(the rule's bound: 0.02) |", "|---|---|---|---|---|"]
    lines += [f"| {w} (1/{T // w}) | **{v['verdict']}**{cost_reading(v, c['seeds'])} | "
              + " | ".join(", ".join(f"{x:.2f}" for x in v[k]) or "-" for k in ("R", "R_prime")) + " | "
              + (", ".join(f"{x:+.3f}" for x in v["first_gap"]) or "-") + " |" for w, v in verdicts.items()]
    for r in (r for r in rows if "reproduces_committed" in r):  # retrained for the split where checkpoints were lost
        if r["reproduces_committed"]:
            lines += ["", f"retrained {r['name']}: logs the committed run's evals exactly"]
        else:
            (_, *c0), (_, *n0), (_, *c1), (_, *n1) = r["curve"][0], r["retrain"]["curve"][0], r["curve"][-1], \
                r["retrain"]["curve"][-1]
            lines += ["", f"retrained {r['name']}: its evals differ from the committed run's, by "
                      f"{max(abs(a - b) for a, b in zip(c0, n0)):.1e} at iteration 0; final first / copied half "
                      f"{c1[0]:.3f} / {c1[1]:.3f} committed (kept for the rule), {n1[0]:.3f} / {n1[1]:.3f} retrained"]
    lines += long_lines(long_verdict(rows, long_rows), rows, long_rows)
    lines += ["", f"full attention ignores the window: {check['iters']} iterations at w = {check['windows'][0]} and "
              f"{check['windows'][1]} log {'identical' if check['identical'] else 'DIFFERENT'} training losses"]
    if paths:
        lines += ["", f"What carries the copy: {c['copy_val']} val copy sequences (the same for every model), "
                  f"{c['path_draws']} draws; a copied-half query is direct where its source is in its SA window "
                  "in some layer and head", "",
                  "| model | first half | copied half | direct: share (masks predict) | loss direct | loss other | "
                  "SA gate by layer | reading | used layers (SA gate >= 0.1): loss direct / other, reading |",
                  "|---|---|---|---|---|---|---|---|---|"]
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        used = lambda u: "needs the model (more than one layer used)" if u is None else (  # noqa: E731
            f"{', '.join(map(str, u[0])) or 'none'}: {fmt(u[1])} / {fmt(u[2])}, {u[3]}")
        lines += [f"| {name} | {q['first']:.3f} | {q['second']:.3f} | {q['direct']:.3f} ({q['direct_predicted']:.3f}) | "
                  f"{fmt(q['loss_direct'])} | {fmt(q['loss_other'])} | "
                  + ", ".join(f"{layer['gate_sa']:.2f}" for layer in q["layers"]) + f" | {q['reading']} | "
                  f"{used(used_split(q))} |" for name, q in sorted(paths.items(), key=lambda kv: (kv[1]["window"], kv[0]))]
    if swaps:
        lines += ["", f"Training-free: {source} swapped, {c['copy_val']} val copy sequences; loss on the copied half "
                  f"(unswapped: {unswapped:.3f})",
                  "", "| w | attn | keys (copied half's queries) | loss | source in SA window |", "|---|---|---|---|---|"]
        lines += [f"| {r['window']} | {r['attn']} | {r['keys']:.1f} | {mean_std(r['second'])} | "
                  + (f"{r['source_in_window']:.3f}" if "source_in_window" in r else "-") + " |" for r in swaps]
        lines += ["", f"verdict (claim 6b): **{swap_v}**"]
    return "\n".join(lines)


def coverage():
    run("results/receptive_field.py", "--grid=True", f"--json_out={os.path.join(out, 'coverage.json')}",
        f"--plot={os.path.join(out, 'coverage.png')}", *COVER)
    run("results/receptive_field.py", "--grid=True", "--sa_rule=value", f"--json_out={os.path.join(out, 'coverage_value.json')}",
        *COVER)  # SA's value rule: does the coverage result hold for it too?
    return "see results/coverage.json, coverage_value.json and the tables receptive_field.py printed"


# The class demo (issue 46, README's "See SA reach"): recall whose every answer lies beyond SWA's reach, n_layer *
# (window - 1) tokens, but within SA+SWA's coverage; config/recall_demo.py is the recipe, results/README.md its search.
DEMO = dict(preset="config/recall_demo.py", kinds=("swa", "sa+swa", "full"),
            data=["--mqar_seq_len=64", "--mqar_num_pairs=1", "--mqar_num_queries=1", "--mqar_vocab=32",
                  "--mqar_offset=1"])


def demo():
    """SWA, SA+SWA and full attention on the demo's recall task, a run of each per seed of demo_seeds, two at a time:
    a table (answer accuracy, val loss, keys a query sees, how many answers the attention graph reaches) and
    demo.png, accuracy over iterations beside how the graph's coverage grows with depth (receptive_field.py)."""
    import receptive_field as rf

    from model import KINDS, GPTConfig
    recipe = {}
    exec(open(os.path.join(ROOT, DEMO["preset"])).read(), recipe)
    c = GPTConfig(**{k: recipe[k] for k in ("block_size", "n_layer", "n_head", "n_embd", "window", "sa_draw")})
    iters = 8 if fast else recipe["max_iters"]
    data = mqar_data("data-demo", DEMO["data"])
    run_dir = lambda kind, s: os.path.join(work, f"demo-{kind}-s{s}")  # noqa: E731
    seeds_ = [int(s) for s in demo_seeds.split(",")]
    train_all([(run_dir(kind, s), dict(presets=[DEMO["preset"]], data_root=data, attn=kind, seed=s, max_iters=iters,
                                       eval_interval=max(1, iters // 10))) for s in seeds_ for kind in DEMO["kinds"]])
    x, y = recall_val(300, data)
    meta = json.load(open(os.path.join(data, "mqar", "meta.json")))["mqar"]
    heads = c.n_head if c.sa_draw == "head" else 1
    reach = {kind: predictions(kind, c.sa_draw, c.n_head, c.n_layer, x, y, c.window, 1)["reachable"]
             for kind in DEMO["kinds"]}
    rows = [dict(attn=kind, seed=s, val_acc=log[-1]["val_acc"], val_loss=log[-1]["val_loss"],
                 keys=KINDS[kind].keys_seen(c, c.block_size), reachable=reach[kind],
                 curve=[(r["iter"], r["val_acc"]) for r in log], wall_s=wall_and_resumes(run_dir(kind, s))["wall_s"])
            for s in seeds_ for kind in DEMO["kinds"] for log in [evals(run_dir(kind, s))]]
    layers = range(c.n_layer + 4)
    total = rf.pairs(c.block_size, "causal")
    coverage = {kind: [n / total for n in rf.simulate(c.block_size, c.window, kind, "causal", heads, layers[-1], 0)[2]]
                for kind in ("swa", "sa+swa")}
    save("demo.json", dict(recipe={k: v for k, v in recipe.items() if k[:1].islower() and isinstance(
        v, (int, float, str, bool))}, data=DEMO["data"], min_gap=meta["min_gap"], swa_reach=c.n_layer * (c.window - 1),
        chance=1 / (32 - 1 - meta["num_keys"]), runs=rows, coverage=coverage))
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(9, 3.4))
    for i, kind in enumerate(DEMO["kinds"]):
        for r in (r for r in rows if r["attn"] == kind):
            it, acc = zip(*r["curve"])
            axes[0].plot(it, acc, color=f"C{i}", alpha=1 if r["seed"] == seeds_[0] else 0.4,
                         label=kind if r["seed"] == seeds_[0] else None)
    axes[0].axhline(1 / (32 - 1 - meta["num_keys"]), color="gray", ls=":", lw=0.8, label="chance")
    axes[0].set(ylim=(0, 1.03), xlabel="iteration", ylabel="val answer accuracy", title=f"recall, answers >= {meta['min_gap']} back; "
                f"SWA reaches {c.n_layer * (c.window - 1)}")
    for i, kind in enumerate(("swa", "sa+swa")):
        axes[1].plot(list(layers)[:len(coverage[kind])], coverage[kind], marker="o", color=f"C{i}", label=kind)
    axes[1].axvline(c.n_layer, color="gray", ls="--", lw=0.8, label=f"the model's {c.n_layer} layers")
    axes[1].set(xlabel="layers", ylabel="(query, key) pairs connected", title=f"coverage: T={c.block_size}, "
                f"window {c.window}, {heads} permutations per layer")
    for ax in axes:
        ax.legend(fontsize=8, title_fontsize=8)
        ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "demo.png"), dpi=120)
    chance = 1 / (32 - 1 - meta["num_keys"])
    lines = [f"recall: {c.n_layer} layers, window {c.window}; every answer >= {meta['min_gap']} tokens back, SWA reaches "
             f"{c.n_layer} x ({c.window} - 1) = {c.n_layer * (c.window - 1)}; chance {chance:.3f}; {iters} iterations",
             "", "| kind | seed | accuracy | val loss | keys per query | answers the graph reaches | minutes |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['attn']} | {r['seed']} | {r['val_acc']:.3f} | {r['val_loss']:.3f} | {r['keys']:g} | "
              f"{r['reachable']:.2f} | {r['wall_s'] / 60:.1f} |" for r in rows]
    return "\n".join(lines + ["", f"figure: {os.path.join(out, 'demo.png')}"])


def speed():
    run("results/bench.py", f"--json_out={os.path.join(out, 'speed_cpu.json')}", *SPEED)
    with open(os.path.join(out, "speed_cpu.json")) as f:
        return json.load(f)["table"]


if __name__ == "__main__":
    steps = dict(figure=figure, lm=lm, swap=swap, mqar_search=mqar_search, mqar=mqar, mqar_decisive=mqar_decisive,
                 recall_swap=recall_swap, coverage=coverage, speed=speed, sa_rules=sa_rules, lm1024=lm1024, demo=demo)
    chosen = [s for s in only.split(",") if s] or [s for s in steps if fast or s not in EXTRA]
    unknown = set(chosen) - steps.keys()
    if unknown:
        sys.exit(f"--only: unknown experiment(s) {sorted(unknown)}; choose from {list(steps)}")
    provenance()  # the commit and command each row records, fixed before this run writes anything
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "summary.md")
    sections = {}  # summary.md keeps the sections of experiments not rerun now
    if os.path.exists(path):
        for part in open(path).read().split("\n## ")[1:]:
            sections[part.split(" ", 1)[0]] = "## " + part.rstrip("\n") + "\n"
    for name in chosen:
        t0 = time.time()
        text = steps[name]()
        sections[name] = f"## {name} ({time.time() - t0:.0f} s{', --fast' if fast else ''})\n\n{text}\n"
        print(sections[name], flush=True)
    with open(path, "w") as f:
        f.write("# Results in miniature (python results/reproduce.py)\n\n"
                + "\n".join(sections[n] for n in steps if n in sections))
