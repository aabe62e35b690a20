"""
Claim 5's mechanism, far copying of real text at T=1024, and claim 6(b) on it, under the pre-registered rules
(results/preregistered.md; as code in copy_rule.py). Step lm1024 of results/reproduce.py: a plain byte LM at T=1024
(its val loss split by copy distance), the copy task (each sequence a 512-byte passage twice) at three windows and
for 12,000 iterations at the widest, what carries the copy (copy_paths.py), and the training-free swap of the
full-attention copy model. Writes lm1024.json, lm1024.png, lm1024_paths.png and lm1024_long.png.
"""
import json
import os
import statistics
import sys

import common
import copy_paths
from common import evals, finished, mean_std, seeds_where, train_all, wall_and_resumes
from copy_rule import above_bound, long_verdict, swap_verdict_of, window_verdicts
from lm import CONTEXT, SWAP_KINDS, copy_distance, lm_val, moba_budget, nll, swapped_nll, visible_keys
from provenance import stamp

SIZES = dict(T=1024, window=32, wide=128, windows=[32, 64, 128], seeds=[0, 1, 2], plain_iters=4500, copy_iters=4000,
             val_windows=48, copy_val=32, swap_windows=[16, 32, 64, 128, 256, 512], draws=3, path_draws=8,
             extra=dict(eval_interval=250, eval_iters=16),
             long_iters=12000, long_eval=500)  # SA+SWA and SWA at "wide" for 3x the copy task's iterations
FAST = dict(T=64, window=4, wide=8, windows=[4, 8], seeds=[0], plain_iters=6, copy_iters=6, val_windows=4, copy_val=4,
            swap_windows=[4, 8, 32], draws=2, path_draws=2, extra=dict(eval_interval=3, eval_iters=2),
            long_iters=12, long_eval=6)


def sizes():
    return FAST if common.fast else SIZES


def lm1024_runs(data):
    """{name: (out_dir, train.py args)} in training order: the copy task seed by seed, the plain LM, and the runs
    beside the rule at the widest window; then the other windows (c["windows"], every one past the first) and the
    per-layer arm; then the long runs at c["wide"], c["long_iters"] iterations with the cosine over them, named
    -i<iters>. Full attention reads no window: its runs at c["window"] serve every window (full_window_check)."""
    c, w = sizes(), sizes()["window"]
    cells = [("copy", kind, w, s) for s in c["seeds"] for kind in ("full", "sa+swa", "swa")]
    cells += [("plain", kind, w, s) for s in c["seeds"] for kind in ("full", "swa")]
    cells += [("copy", "sa+swa", c["wide"], s) for s in c["seeds"]] + [("copy", "moba", w, c["seeds"][0])]
    cells += [("copy", kind, wi, s) for wi in c["windows"][1:] for s in c["seeds"] for kind in ("swa", "sa+swa")]
    cells += [("copy", "sa+swa", c["wide"], c["seeds"][0], "layer")]
    cells += [("copy", kind, c["wide"], s, "head", c["long_iters"]) for s in c["seeds"] for kind in ("sa+swa", "swa")]
    runs = {}
    for task, kind, window, seed, perm, iters in ((*cell, *(None, None)[len(cell) - 4:]) for cell in cells):
        name = f"{task}-{kind}-w{window}-s{seed}" + (f"-{perm}" if perm and perm != "head" else "") \
            + (f"-i{iters}" if iters else "")  # a repeated cell (the w=128 arm beside the rule) keeps its first place
        long = dict(max_iters=iters, lr_decay_iters=iters, eval_interval=c["long_eval"]) if iters else {}
        runs.setdefault(name, (os.path.join(common.work, "lm1024", name), dict(
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
    path = os.path.join(common.work, "data", "pystdlib")
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
    path = os.path.join(common.work, "data", "pystdlib")
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


def full_window_check(data, iters=None):
    """Whether full attention's copy runs serve every window: the first iterations of full attention at the
    smallest and the widest window, same seed, log the same training losses."""
    c = sizes()
    iters = iters or (3 if common.fast else 20)
    losses = {}
    for w in (c["window"], c["windows"][-1]):
        out_dir = os.path.join(common.work, "lm1024", f"full-window-check-w{w}")
        common.run("train.py", "config/quick.py", f"--out_dir={out_dir}", f"--data_root={data}", "--attn=full",
            f"--window={w}", f"--block_size={c['T']}", "--batch_size=2", f"--seed={c['seeds'][0]}", "--copy_task=True",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={iters}", "--eval_iters=1",
            "--log_interval=1", "--overwrite=True",
            threads=1)
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            losses[w] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    a, b = losses.values()
    return dict(windows=list(losses), iters=iters, identical=a == b, losses=a)



def lm1024(names="", train=True):
    """Trains the runs of lm1024_runs (those in `names`, a comma list; "" = every run; none if train is False), then
    builds lm1024.json and its plots from every finished run: the plain LM's val loss split by copy distance, the
    copy task's halves and verdicts, what carries the copy, and the training-free swap of the full-attention copy
    model (first seed). A run finished on a machine whose checkpoints are gone keeps its committed row."""
    import numpy as np

    from checkpoint import load_checkpoint
    from lm import data as lm_data
    c = sizes()
    T, w0, data = c["T"], c["window"], lm_data()
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
    committed = common.committed("lm1024.json")
    old = {r["name"]: r for part in ("runs", "long_runs") for r in committed.get(part, [])}
    rows, long_rows = [], []  # the long runs (-i<iters>) kept apart, so that the rule reads only its own runs
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
    paths = committed.get("copy_paths", {})  # what carries the copy, per SA+SWA copy model
    for name, od in done.items():
        task, kind, window, seed, sa_draw, long = lm1024_cell(name)
        if (task, kind) == ("copy", "sa+swa") and not long:
            model = load_checkpoint(os.path.join(od, "ckpt.pt"))[0].eval()
            paths[name] = dict(window=window, seed=seed, sa_perm=sa_draw,
                               **copy_paths.measure(model, xc, yc, c["path_draws"]))
    verdicts = window_verdicts(rows, c)

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
        swap_v = swap_verdict_of(swaps, T)
    elif committed.get("swap_source") == source:  # its checkpoint is gone: keep the committed swap
        swaps, swap_v, unswapped = committed["swap"], committed["swap_verdict"], committed["swap_full"]
    check = full_window_check(data) if train or "full_window_check" not in committed else committed["full_window_check"]
    common.save("lm1024.json", dict(
        setup=c, reach=reach, context=CONTEXT, split_tokens={p: int(m.sum()) for p, m in parts.items()}, runs=rows,
        copy_verdict=verdicts[w0]["verdict"], R=verdicts[w0]["R"], verdicts=verdicts, full_window_check=check,
        copy_paths=dict(sorted(paths.items(), key=lambda kv: (kv[1]["window"], kv[0]))), swap_source=source,
        swap_full=unswapped, swap=swaps, swap_verdict=swap_v, long_runs=long_rows,
        long_verdict=long_verdict(rows, long_rows, c),
        halves="first: targets 0..T/2-2 (plain LM); second: targets T/2-1..T-2 (copies)"),
        verdicts=("copy_verdict", "swap_verdict", "long_verdict"))
    p = common.plt()
    plot(p, rows, swaps, unswapped, source, c)
    if paths:
        copy_paths.plot(p, paths, T)
    if long_rows:
        long_plot(p, rows, long_rows, c)


COLOR = {"swa": "C0", "sink": "C1", "sa": "C2", "moba": "C3", "full": "k", "sa+swa": "C4"}  # every panel alike


def cell(r):
    """A copy run's cell: (attn, window, sa_draw)."""
    return r["attn"], r["window"], r.get("sa_perm", "head")


def plot(p, rows, swaps, unswapped, source, c):
    """lm1024.png: the copied half over training, per run; and the full-attention copy model swapped, no training."""
    fig, axes = p.subplots(1, 2, figsize=(10, 3.8))
    T, style = c["T"], dict(zip(c["windows"], ["-", "--", ":"]))
    for kind, w, perm in sorted({cell(r) for r in rows if r["task"] == "copy"}, key=lambda k: (k[1], k[0], k[2])):
        for r in [r for r in rows if r["task"] == "copy" and cell(r) == (kind, w, perm)]:
            it, _, second = zip(*r["curve"])
            first = r["seed"] == c["seeds"][0]
            name = f"{kind}, w={w}{', per layer' * (perm == 'layer')}" if kind != "full" else "full (any w)"
            axes[0].plot(it, second, color=COLOR[kind], ls="-." if perm == "layer" else style.get(w, "-"), lw=1,
                         alpha=1 if first else 0.5, label=name if first else None)
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel("val loss on the copied half (nats per byte)")
    axes[0].set_title(f"trained on the copy task (T={T}, source {T // 2} back)", fontsize=9)
    for kind in SWAP_KINDS:
        rs = [r for r in swaps if r["attn"] == kind]
        axes[1].plot([r["window"] for r in rs], [statistics.mean(r["second"]) for r in rs], marker="o",
                     color=COLOR[kind], label={"sink": "swa + sink"}.get(kind, kind))
    if unswapped is not None:
        axes[1].axhline(unswapped, color=COLOR["full"], ls="--", lw=0.8, label="full (unswapped)")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("window w")
    axes[1].set_ylabel("loss on the copied half (nats per byte)")
    axes[1].set_title(f"{source}, attention swapped, no training", fontsize=9)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "lm1024.png"), dpi=120)


def long_plot(p, rows, long_rows, c):
    """lm1024_long.png: the copied half over training, 12,000-iteration runs (solid) beside the committed
    4,000-iteration ones (dashed) and full attention's (black), per seed."""
    fig, axes = p.subplots(1, len(c["seeds"]), figsize=(11, 3.4), sharey=True, squeeze=False)
    axes, w = axes[0], long_rows[0]["window"]
    for ax, s in zip(axes, c["seeds"]):
        for kind, color in (("sa+swa", "C4"), ("swa", "C0")):
            for r, ls, what in ([r for r in long_rows if (r["attn"], r["seed"]) == (kind, s)], "-", "12,000"), (
                    [r for r in rows if r["task"] == "copy" and r["seed"] == s and cell(r) == (kind, w, "head")],
                    "--", "4,000"):
                for row in r:
                    it, _, second = zip(*row["curve"])
                    ax.plot(it, second, color=color, ls=ls, lw=1, label=f"{kind}, {what} iterations")
        for row in [r for r in rows if (r["task"], r["attn"], r["seed"]) == ("copy", "full", s)][:1]:
            it, _, second = zip(*row["curve"])
            ax.plot(it, second, color="k", lw=1, label="full, 4,000 iterations")
        ax.set(xlabel="iteration", title=f"seed {s}, w = {w} (w/T = 1/{c['T'] // w})")
        ax.title.set_fontsize(9)
    axes[0].set_ylabel("val loss on the copied half (nats per byte)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "lm1024_long.png"), dpi=120)


def label(v):
    """A verdict as the rule words it, with its pre-registered wording where that applies (nothing more)."""
    return f"**{v['verdict']}**" + (f": {v['reading']}" if v.get("reading") else "")


def three(xs, places=3, sign=""):
    return ", ".join(f"{x:{sign}.{places}f}" for x in xs)


def summary(doc):
    """lm1024.json's tables: the plain LM's split, the copy task per run and over training, the rule per window,
    the retrains, the 12,000-iteration runs, what carries the copy, and the training-free swap."""
    c, rows = doc["setup"], doc["runs"]
    T, w0 = c["T"], c["window"]
    by = lambda task, kind: [r for r in rows if (r["task"], r["attn"], r["window"]) == (task, kind, w0)]  # noqa: E731
    lines = [f"Plain LM (T={T}, {c['plain_iters']} iterations): val loss on {c['val_windows']} windows, split by copy "
             f"distance (far: >= {doc['reach']}, SWA's reach)", "",
             "| attn | seeds | val loss | all | far copies | far, 9-gram unseen in train | near copies |",
             "|---|---|---|---|---|---|---|"]
    parts = ("all", "far", "far_unseen", "near")
    for kind in ("full", "swa"):
        if rs := by("plain", kind):
            lines.append(f"| {kind} | {len(rs)} | {mean_std([r['val_loss'] for r in rs])} | " + " | ".join(
                "-" if rs[0]["split"][p] is None else mean_std([r["split"][p] for r in rs]) for p in parts) + " |")
    full, swa = by("plain", "full"), by("plain", "swa")
    if full and [r["seed"] for r in full] == [r["seed"] for r in swa]:
        lines.append("| full − swa, per seed | | | " + " | ".join(", ".join(
            "-" if f["split"][p] is None else f"{f['split'][p] - s['split'][p]:+.4f}" for f, s in zip(full, swa))
            for p in parts) + " |")
    steps = range(0, c["copy_iters"] + 1, c["copy_iters"] // 4)
    lines += ["", "tokens: " + ", ".join(f"{p} {n:,}" for p, n in doc["split_tokens"].items()), "",
              f"Copy task (T={T}, {c['copy_iters']} iterations): val loss on the first half / the copied half, per "
              f"seed (each seed's own val sequences); full attention's runs at w = {w0} serve every window", "",
              "| attn | window (w/T) | seeds | first half | copied half | copied − first |", "|---" * 6 + "|"]
    for kind, w, perm in sorted({cell(r) for r in rows if r["task"] == "copy"}, key=lambda k: (k[1], k[0], k[2])):
        rs = [r for r in rows if r["task"] == "copy" and cell(r) == (kind, w, perm)]
        lines.append(f"| {kind}{' (one permutation per layer)' * (perm == 'layer')} | {w} (1/{T // w}) | "
                     + ", ".join(str(r["seed"]) for r in rs) + f" | {three(r['first'] for r in rs)} | "
                     f"{three(r['second'] for r in rs)} | {three((r['second'] - r['first'] for r in rs), sign='+')} |")
    lines += ["", "SA+SWA's copied − first half minus SWA's, per seed, over training (negative: SA+SWA copies more):",
              "",
              "| window | seed | " + " | ".join(map(str, steps)) + " |", "|---|---|" + "---|" * len(steps)]
    for w in c["windows"]:
        for s in c["seeds"]:
            pair = [next((r for r in rows if r["task"] == "copy" and cell(r) == (kind, w, "head") and r["seed"] == s),
                         None) for kind in ("sa+swa", "swa")]
            if all(pair):
                sa_gap = {it: second - first for it, first, second in pair[0]["curve"]}
                gap = {it: sa_gap[it] - (second - first) for it, first, second in pair[1]["curve"] if it in sa_gap}
                lines.append(f"| {w} | {s} | " + " | ".join(f"{gap[i]:+.3f}" if i in gap else "-" for i in steps)
                             + " |")
    lines += ["", "| window (w/T) | verdict (claim 5's mechanism) | R per seed | R' per seed "
              "| SA+SWA's first half − SWA's (the rule's bound: 0.02) | above the bound in |", "|---" * 6 + "|"]
    lines += [f"| {w} (1/{T // int(w)}) | {label(v)} | {three(v['R'], 2) or '-'} | {three(v['R_prime'], 2) or '-'} | "
              f"{three(v['first_gap'], sign='+') or '-'} | {seeds_where(c['seeds'], above_bound(v['first_gap']))} |"
              for w, v in doc["verdicts"].items()]
    for r in (r for r in rows if "reproduces_committed" in r):  # retrained for the split where checkpoints were lost
        if r["reproduces_committed"]:
            lines += ["", f"retrained {r['name']}: logs the committed run's evals exactly"]
            continue
        (_, *c0), (_, *n0), (_, *c1), (_, *n1) = r["curve"][0], r["retrain"]["curve"][0], r["curve"][-1], \
            r["retrain"]["curve"][-1]
        lines += ["", f"retrained {r['name']}: its evals differ from the committed run's, by "
                  f"{max(abs(a - b) for a, b in zip(c0, n0)):.1e} at iteration 0; final first / copied half "
                  f"{c1[0]:.3f} / {c1[1]:.3f} committed (kept for the rule), {n1[0]:.3f} / {n1[1]:.3f} retrained"]
    lines += long_summary(doc)
    check = doc["full_window_check"]
    lines += ["", f"full attention ignores the window: {check['iters']} iterations at w = {check['windows'][0]} and "
              f"{check['windows'][1]} log {'identical' if check['identical'] else 'DIFFERENT'} training losses"]
    if doc["copy_paths"]:
        lines += ["", copy_paths.table(doc["copy_paths"], c["copy_val"], c["path_draws"])]
    if doc["swap"]:
        lines += ["", f"Training-free: {doc['swap_source']} swapped, {c['copy_val']} val copy sequences; loss on the "
                  f"copied half (unswapped: {doc['swap_full']:.3f})",
                  "", "| w | attn | keys (copied half's queries) | loss | source in SA window |", "|---" * 5 + "|"]
        lines += [f"| {r['window']} | {r['attn']} | {r['keys']:.1f} | {mean_std(r['second'])} | "
                  + (f"{r['source_in_window']:.3f}" if "source_in_window" in r else "-") + " |" for r in doc["swap"]]
        lines += ["", f"verdict (claim 6b): **{doc['swap_verdict']}**"]
    return "\n".join(lines)


def long_summary(doc):
    """The 12,000-iteration runs: the question, the rule at 12,000, and iterations 4,000 and 8,000 beside it; SWA's
    halves from its 4,000- to its 12,000-iteration runs, and full attention's copied half to 4 places."""
    v, c = doc["long_verdict"], doc["setup"]
    if "answers" not in v:
        return ["", f"12,000-iteration runs: {v['verdict']}"]
    at, seeds = {int(it): a for it, a in v["at"].items()}, v["seeds"]
    lines = ["", f"SA+SWA and SWA at w = {v['window']} for {v['iters']:,} iterations (the cosine over "
             f"{v['iters']:,}), full attention's 4,000-iteration runs as L2(full); per seed "
             + ", ".join(map(str, seeds)), "",
             "| iteration of the long runs | SA+SWA copied half | SA+SWA first half | SWA copied half | SWA first half "
             "| copy advantage (SWA's copied - SA+SWA's) | R | R' | verdict by the rule "
             "| first half above SWA's + 0.02 in |", "|---" * 10 + "|"]
    for it, a in at.items():
        swa_copied = [x + y for x, y in zip(a["copied"], a["advantage"])]
        lines.append(f"| {it:,} | {three(a['copied'])} | {three(a['first'])} | {three(swa_copied)} | "
                     f"{three(a['swa_first'])} | {three(a['advantage'])} | {three(a['R'], 2)} | "
                     f"{three(a['R_prime'], 2)} | {label(a)} | {seeds_where(seeds, above_bound(a['first_gap']))} |")
    gains = [a - b for a, b in zip(at[v["iters"]]["advantage"], v["advantage_4k_committed"])]
    lines += ["", f"copy advantage of the committed 4,000-iteration runs: {three(v['advantage_4k_committed'])}; at "
              f"{v['iters']:,}: {three(at[v['iters']]['advantage'])}; gain {three(gains, sign='+')}",
              f"SA+SWA's first half minus SWA's at {v['iters']:,}: {three(v['first_gap'], sign='+')}",
              f"the question, per seed: {', '.join(v['answers'])}; over all seeds: **{v['answer']}**",
              f"the rule at {v['iters']:,}: {label(v)}; first half above SWA's + 0.02 in "
              f"{seeds_where(seeds, above_bound(v['first_gap']))}"]
    run = {(r["attn"], r["window"], r["seed"], r["iters"]): r for r in doc["runs"] + doc["long_runs"]
           if r["task"] == "copy" and r.get("sa_perm", "head") == "head"}
    swa = [(run["swa", v["window"], s, v["iters"]], run["swa", v["window"], s, c["copy_iters"]]) for s in seeds]
    full = [run["full", c["window"], s, c["copy_iters"]]["second"] for s in seeds]
    return lines + [f"SWA's copied / first half, {v['iters']:,} minus its 4,000-iteration runs: " + ", ".join(
        f"{b['second'] - a['second']:+.3f} / {b['first'] - a['first']:+.3f}" for b, a in swa),
        f"full attention's copied half (L2(full)): {three(full, 4)}; SA+SWA's at {v['iters']:,} is "
        + ", ".join(f"{x / f:.0f}" for x, f in zip(at[v["iters"]]["copied"], full)) + " times it"]
