"""
The class demo (README's "See SA reach"): recall whose every answer lies beyond SWA's reach, n_layer * (window - 1)
tokens, but within SA+SWA's coverage. config/recall_demo.py is the recipe. Step demo of results/reproduce.py, run only
when named: `--only=demo --out=out-demo` trains seed 0 of SWA, SA+SWA and full attention and writes demo.json and
demo.png there.
"""
import json
from dataclasses import replace
import os

import common
import receptive_field as rf
from common import evals, train_all, wall_and_resumes
from recall import mqar_data, predictions, recall_val

DEMO = dict(preset="config/recall_demo.py", kinds=("swa", "sa+swa", "full"),
            data=["--mqar_seq_len=64", "--mqar_num_pairs=1", "--mqar_num_queries=1", "--mqar_vocab=32",
                  "--mqar_offset=1"])


def demo(demo_seeds="0"):
    """SWA, SA+SWA and full attention on the demo's recall task, a run of each per seed of demo_seeds, two at a time:
    a table (answer accuracy, val loss, keys a query sees, how many answers the attention graph reaches) and
    demo.png, accuracy over iterations beside how the graph's coverage grows with depth (receptive_field.py)."""
    from model import GPTConfig, keys_seen
    recipe = {}
    exec(open(os.path.join(common.ROOT, DEMO["preset"])).read(), recipe)
    c = GPTConfig(**{k: recipe[k] for k in ("block_size", "n_layer", "n_head", "n_embd", "window", "sa_draw")})
    iters = 8 if common.fast else recipe["max_iters"]
    data = mqar_data("data-demo", DEMO["data"])
    run_dir = lambda kind, s: os.path.join(common.work, f"demo-{kind}-s{s}")  # noqa: E731
    seeds_ = [int(s) for s in demo_seeds.split(",")]
    train_all([(run_dir(kind, s), dict(presets=[DEMO["preset"]], data_root=data, attn=kind, seed=s, max_iters=iters,
                                       eval_interval=max(1, iters // 10))) for s in seeds_ for kind in DEMO["kinds"]])
    x, y = recall_val(300, data)
    meta = json.load(open(os.path.join(data, "mqar", "meta.json")))["mqar"]
    heads = c.n_head if c.sa_draw == "head" else 1
    reach = {kind: predictions(kind, c.sa_draw, c.n_head, c.n_layer, x, y, c.window, 1)["reachable"]
             for kind in DEMO["kinds"]}
    rows = [dict(attn=kind, seed=s, val_acc=log[-1]["val_acc"], val_loss=log[-1]["val_loss"],
                 keys=keys_seen(replace(c, attn=kind), c.block_size), reachable=reach[kind],
                 curve=[(r["iter"], r["val_acc"]) for r in log], wall_s=wall_and_resumes(run_dir(kind, s))["wall_s"])
            for s in seeds_ for kind in DEMO["kinds"] for log in [evals(run_dir(kind, s))]]
    layers = range(c.n_layer + 4)
    total = rf.pairs(c.block_size, "causal")
    coverage = {kind: [n / total for n in rf.simulate(c.block_size, c.window, kind, "causal", heads, layers[-1], 0)[2]]
                for kind in ("swa", "sa+swa")}
    common.save("demo.json", dict(recipe={k: v for k, v in recipe.items() if k[:1].islower() and isinstance(
        v, (int, float, str, bool))}, data=DEMO["data"], min_gap=meta["min_gap"], swa_reach=c.n_layer * (c.window - 1),
        chance=1 / (32 - 1 - meta["num_keys"]), runs=rows, coverage=coverage))
    p = common.plt()
    fig, axes = p.subplots(1, 2, figsize=(9, 3.4))
    for i, kind in enumerate(DEMO["kinds"]):
        for r in (r for r in rows if r["attn"] == kind):
            it, acc = zip(*r["curve"])
            axes[0].plot(it, acc, color=f"C{i}", alpha=1 if r["seed"] == seeds_[0] else 0.4,
                         label=kind if r["seed"] == seeds_[0] else None)
    axes[0].axhline(1 / (32 - 1 - meta["num_keys"]), color="gray", ls=":", lw=0.8, label="chance")
    axes[0].set(ylim=(0, 1.03), xlabel="iteration", ylabel="val answer accuracy",
                title=f"recall, answers >= {meta['min_gap']} back; SWA reaches {c.n_layer * (c.window - 1)}")
    for i, kind in enumerate(("swa", "sa+swa")):
        axes[1].plot(list(layers)[:len(coverage[kind])], coverage[kind], marker="o", color=f"C{i}", label=kind)
    axes[1].axvline(c.n_layer, color="gray", ls="--", lw=0.8, label=f"the model's {c.n_layer} layers")
    axes[1].set(xlabel="layers", ylabel="(query, key) pairs connected", title=f"coverage: T={c.block_size}, "
                f"window {c.window}, {heads} permutations per layer")
    for ax in axes:
        ax.legend(fontsize=8, title_fontsize=8)
        ax.title.set_fontsize(8)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "demo.png"), dpi=120)


def summary(doc):
    """demo.json's table: each kind and seed, its accuracy beside what the attention graph reaches."""
    n_layer, window = doc["recipe"]["n_layer"], doc["recipe"]["window"]
    lines = [f"recall: {n_layer} layers, window {window}; every answer >= {doc['min_gap']} tokens back, SWA reaches "
             f"{n_layer} x ({window} - 1) = {doc['swa_reach']}; chance {doc['chance']:.3f}; "
             f"{doc['runs'][0]['curve'][-1][0]} iterations", "",
             "| kind | seed | accuracy | val loss | keys per query | answers the graph reaches | minutes |",
             "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {r['attn']} | {r['seed']} | {r['val_acc']:.3f} | {r['val_loss']:.3f} | "
                              f"{r['keys']:g} | {r['reachable']:.2f} | {r['wall_s'] / 60:.1f} |" for r in doc["runs"]])
