"""
Reproduce the paper in miniature on a CPU: every table and plot in the README's Results.

    python results/reproduce.py                 # everything (about 1.5 h on 2 CPU cores)
    python results/reproduce.py --fast=True     # a tiny version of everything, a couple of minutes (tested in CI)
    python results/reproduce.py --only=mqar,lm  # some experiments: figure, lm, swap, mqar, coverage, speed

Each experiment runs the repo's own scripts (train.py, eval.py, receptive_field.py,
attention.py) as subprocesses, printing every command, and writes one JSON (and its
PNG plots) into --out (default results/). summary.md collects the tables that the
README quotes. The swap experiment evaluates the full-attention model that lm trained.
"""
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# -----------------------------------------------------------------------------
fast = False            # tiny sizes everywhere: checks the pipeline, not the claims
only = ""               # comma list of experiments ("" = all)
out = os.path.join(ROOT, "results")  # JSON, PNG and summary.md go here
work = os.path.join(ROOT, "out-reproduce")  # data and checkpoints (not committed)
jobs = 2                # training runs in parallel, one thread each (2 cores: faster than 2 threads per run)
# -----------------------------------------------------------------------------
exec(open(os.path.join(ROOT, "configurator.py")).read())

KINDS = ["full", "swa", "sa", "sa+swa", "moba"]
if fast:
    MQAR = dict(iters=30, seeds=[0], depths=[1, 2], data=["--mqar_train_seqs=512", "--mqar_val_seqs=64"])
    LM = dict(iters=20, seeds=[0], eval_interval=10)
    SWAP = dict(windows="8,32", seeds=2, limit=4)
    COVER = ["--grid_n=256,1024", "--seeds=2"]
    SPEED = ["--sizes=256,1024"]
else:
    MQAR = dict(iters=1200, seeds=[0, 1], depths=[1, 2, 3, 4], data=[])
    LM = dict(iters=500, seeds=[0, 1], eval_interval=50)
    SWAP = dict(windows="8,16,32,64,128,256", seeds=3, limit=64)
    COVER = []
    SPEED = []


def run(*args, threads=None):
    """Run one of the repo's scripts; returns its wall time in seconds."""
    print("$ python " + " ".join(args), flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.time()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t0


def train_all(runs):
    """train.py once per (out_dir, args), `jobs` at a time, one thread each. A run whose log
    already ends with its final eval is kept: rerunning the same seed would repeat it."""
    def train(out_dir, args):
        if os.path.exists(os.path.join(out_dir, "log.jsonl")) and evals(out_dir)[-1]["iter"] == args["max_iters"]:
            return
        run("train.py", *args["config"], f"--out_dir={out_dir}", *(f"--{k}={v}" for k, v in args.items() if k != "config"),
            threads=1 if jobs > 1 else None)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda r: train(*r), runs))


def evals(out_dir):
    """The evaluation records of a train.py run's log.jsonl."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if "val_loss" in r]


def save(name, obj):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=1)


def mean_std(xs):
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def plt():
    try:
        import matplotlib
    except ImportError:
        sys.exit("results/reproduce.py draws its plots with matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


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


# MQAR, sized to learn on a CPU: 128-token sequences, 4 key-value pairs queried at least
# 113 tokens later, 32 keys and 32 values. Window 16 (SWA reaches 15 tokens per layer);
# MoBA gets the same key budget, 4 blocks of 4.
MQAR_DATA = ["--mqar_seq_len=128", "--mqar_num_pairs=4", "--mqar_num_queries=4", "--mqar_vocab=64"]
MQAR_TRAIN = ["--block_size=128", "--window=16", "--moba_block=4", "--moba_topk=4", "--learning_rate=3e-3",
              "--min_lr=3e-4"]


def mqar():
    """Multi-query associative recall at equal budget: accuracy on the answers by kind, seed and depth."""
    data = os.path.join(work, "data")
    run("prepare_data.py", "--dataset=mqar", f"--data_root={data}", *MQAR_DATA, *MQAR["data"])
    rows = []
    runs = [(k, 2, s) for k in KINDS for s in MQAR["seeds"]]
    runs += [(k, d, MQAR["seeds"][0]) for k in KINDS for d in MQAR["depths"] if d != 2]
    dirs = [os.path.join(work, f"mqar-{kind}-L{depth}-s{seed}") for kind, depth, seed in runs]
    train_all([(od, dict(config=["config/mqar.py", *MQAR_TRAIN], data_root=data, attn=kind, n_layer=depth, seed=seed,
                         max_iters=MQAR["iters"], eval_interval=MQAR["iters"]))
               for (kind, depth, seed), od in zip(runs, dirs)])
    for (kind, depth, seed), od in zip(runs, dirs):
        last = evals(od)[-1]
        rows.append(dict(attn=kind, n_layer=depth, seed=seed, val_acc=last["val_acc"], val_loss=last["val_loss"],
                         wall_s=last["elapsed_s"]))
    save("mqar.json", dict(iters=MQAR["iters"], data=MQAR_DATA, train=["config/mqar.py", *MQAR_TRAIN], runs=rows))

    depths = sorted({r["n_layer"] for r in rows})
    p = plt()
    fig, ax = p.subplots(figsize=(5, 3.4))
    for kind in KINDS:
        accs = [statistics.mean(r["val_acc"] for r in rows if r["attn"] == kind and r["n_layer"] == d) for d in depths]
        ax.plot(depths, accs, marker="o", label=kind)
    ax.set_xlabel("layers")
    ax.set_ylabel("MQAR answer accuracy (val)")
    ax.set_xticks(depths)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mqar.png"), dpi=120)

    lines = ["| attn | accuracy, 2 layers (mean ± std over seeds) | " + " | ".join(f"{d} layers" for d in depths) + " |",
             "|---|---|" + "---|" * len(depths)]
    for kind in KINDS:
        two = [r["val_acc"] for r in rows if r["attn"] == kind and r["n_layer"] == 2]
        by_depth = [statistics.mean(r["val_acc"] for r in rows if r["attn"] == kind and r["n_layer"] == d)
                    for d in depths]
        lines.append(f"| {kind} | {mean_std(two)} | " + " | ".join(f"{a:.3f}" for a in by_depth) + " |")
    return "\n".join(lines)


def lm():
    """Byte-level language modelling on pystdlib: config/quick.py for each kind and seed."""
    data = os.path.join(work, "data")
    run("prepare_data.py", "--dataset=pystdlib", f"--data_root={data}")
    rows, curves = [], {}
    runs = [(kind, seed) for kind in KINDS[:4] for seed in LM["seeds"]]
    dirs = [os.path.join(work, f"lm-{kind}-s{seed}") for kind, seed in runs]
    train_all([(od, dict(config=["config/quick.py"], data_root=data, attn=kind, seed=seed, max_iters=LM["iters"],
                         eval_interval=LM["eval_interval"]))
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


def swap():
    """Training-free: the full-attention model from lm, evaluated with swa, sa and moba over windows."""
    od = os.path.join(work, f"lm-full-s{LM['seeds'][0]}")
    path = os.path.join(out, "swap.json")
    run("eval.py", f"--out_dir={od}", f"--data_root={os.path.join(work, 'data')}", "--attn=full,swa,sa,moba",
        f"--windows={SWAP['windows']}", f"--seeds={SWAP['seeds']}", f"--limit={SWAP['limit']}",
        f"--json={path}", f"--plot={os.path.join(out, 'swap.png')}")
    with open(path) as f:
        res = [r for r in json.load(f)["results"] if r["metric"] == "loss"]
    ws = sorted({r["window"] for r in res if r["window"]})
    full = next(r["value"] for r in res if r["attn"] == "full")
    lines = ["| attn | " + " | ".join(f"w={w}" for w in ws) + " |", "|---|" + "---|" * len(ws),
             f"| full | {full:.3f} (every window) |" + " |" * (len(ws) - 1)]
    for kind in ("swa", "sa", "moba"):
        cell = {r["window"]: r for r in res if r["attn"] == kind}
        lines.append(f"| {kind} | " + " | ".join(
            f"{cell[w]['value']:.3f}" + (f" ± {cell[w]['seed_std']:.3f}" if cell[w]["seed_std"] else "") for w in ws) + " |")
    return "val loss (nats per byte) of the full-attention model with its attention swapped, no training:\n\n" + "\n".join(lines)


def coverage():
    run("receptive_field.py", "--grid=True", f"--json={os.path.join(out, 'coverage.json')}",
        f"--plot={os.path.join(out, 'coverage.png')}", *COVER)
    return "see results/coverage.json and the table receptive_field.py printed"


def speed():
    run("bench.py", f"--json_out={os.path.join(out, 'speed_cpu.json')}", *SPEED)
    with open(os.path.join(out, "speed_cpu.json")) as f:
        return json.load(f)["table"]


if __name__ == "__main__":
    steps = dict(figure=figure, lm=lm, swap=swap, mqar=mqar, coverage=coverage, speed=speed)
    chosen = [s for s in only.split(",") if s] or list(steps)
    unknown = set(chosen) - steps.keys()
    if unknown:
        sys.exit(f"--only: unknown experiment(s) {sorted(unknown)}; choose from {list(steps)}")
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
