"""
Claim 3, SA+SWA ~ full attention on recall: the pre-registered experiment (results/preregistered.md) at the depth
where SA can work. Step mqar_decisive of results/reproduce.py; writes mqar_decisive.json and mqar_decisive.png.

3 layers, window 8, 4 heads of 16 dimensions, each with its own permutation (sa_draw=head; receptive_field.py: every
pair connected in 2 layers at n=64), MoBA at the same key budget (4 chunks of 2). The pairs start at token 1, so no
MoBA chunk holds a whole (cue, value) pair. Arm P=1: one pair, one query (a pure long-range broadcast: any path
carries the value); arm P=4: content recall. Every cell trains with Zoology's optimiser settings (lr 3e-4, warmup,
cosine to 0, beta2 0.999, weight decay 0.01, no clipping): config/mqar.py's depth-2 recipe left full attention on the
plateau at depth 3 (mqar_probes.json).
"""
import json
import os

import common
from common import evals, finished, mean_std, train_all
from recall import mqar_data, predictions, recall_val, sizes

DECISIVE = dict(n_layer=3, window=8, n_head=4, sa_draw="head", moba_chunk=2, moba_topk=4, learning_rate=3e-4,
                decay_lr=True, warmup_iters=200, min_lr=0.0, beta2=0.999, weight_decay=0.01, grad_clip=0.0)
ARMS = {1: dict(iters=3000, cells={"full": 1, "swa": 1, "sa+swa": 2}, confirm=0.9, refute=0.5,
                data=["--mqar_seq_len=64", "--mqar_num_pairs=1", "--mqar_num_queries=1", "--mqar_vocab=32",
                      "--mqar_offset=1"]),
        4: dict(iters=12000, cells={"full": 3, "sa+swa": 3, "swa": 1, "moba": 1}, confirm=0.75, refute=0.35,
                data=["--mqar_seq_len=64", "--mqar_num_pairs=4", "--mqar_num_queries=4", "--mqar_vocab=32",
                      "--mqar_offset=1"])}
# --fast: one seed of two cells per arm, every code path, few runs
FAST = {P: dict(a, iters=8, cells=dict.fromkeys(cells, 1)) for (P, a), cells in
        zip(ARMS.items(), [("full", "sa+swa"), ("sa+swa", "moba")])}


def arm_verdict(arm, accs):
    """The pre-registered rule, literally, for one arm (an ARMS value) and its accuracies {cell: [per seed]}. Valid
    only if every full seed >= 0.95 and SWA <= 0.10. SA+SWA confirms at >= arm["confirm"] in every seed, refutes at
    <= arm["refute"] in every seed; anything between is partial. MoBA is beside the rule, not in it: its run may be
    missing. A finished SA+SWA seed between the thresholds decides "partial": no other seed can change that."""
    sa = accs.get("sa+swa", [])
    between = any(arm["refute"] < x < arm["confirm"] for x in sa)
    missing = [f"{c} {len(accs.get(c, []))} of {n}" for c, n in arm["cells"].items()
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
    if len(sa) < arm["cells"]["sa+swa"]:
        return f"partial ({len(sa)} of {arm['cells']['sa+swa']} SA+SWA seeds finished, one between the thresholds)"
    return "refutes" if max(sa) <= arm["refute"] else "confirms" if min(sa) >= arm["confirm"] else "partial"


def overall_verdict(verdicts):
    """The claim: confirmed if both arms confirm, refuted if either refutes."""
    v = list(verdicts)
    return ("refuted" if "refutes" in v else "confirmed" if v == ["confirms"] * len(v)
            else "not decidable" if any(x.startswith("not") for x in v) else "partial")


def verdicts_of(doc):
    """mqar_decisive.json's verdicts, from its own rows: ({P: the arm's verdict}, the overall verdict)."""
    accs = lambda P, c: [r["val_acc"] for r in doc["runs"] if (str(r["P"]), r["cell"]) == (P, c)]  # noqa: E731
    verdicts = {P: arm_verdict(a, {c: accs(P, c) for c in a["cells"]}) for P, a in doc["arms"].items()}
    return verdicts, overall_verdict(verdicts.values())


def mqar_decisive(arms=""):
    """Both arms of the pre-registered experiment (trains those in `arms`, a comma list of P; "" = both):
    accuracy and val loss per cell and seed, the predictions beside them, and the verdict by the rule."""
    rows, predicted, chosen = [], {}, FAST if common.fast else ARMS
    for P, a in chosen.items():
        data = mqar_data(f"data-recall-P{P}", a["data"])
        out_dir = lambda c, s: os.path.join(common.work, f"decisive-P{P}-{c}-L{DECISIVE['n_layer']}-s{s}")  # noqa
        runs = [(c, s) for c, n in a["cells"].items() for s in range(n)]
        if not arms or str(P) in arms.split(","):
            train_all([(out_dir(c, s), dict(presets=["config/mqar.py", *sizes()["train"]], data_root=data, attn=c,
                                            seed=s, max_iters=a["iters"], eval_interval=a["iters"] // 4, **DECISIVE))
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
    doc = dict(setup=DECISIVE, arms=chosen, train=["config/mqar.py", *sizes()["train"]], runs=rows, predicted=predicted)
    doc["verdicts"], doc["overall"] = verdicts_of(json.loads(json.dumps(doc)))  # keys as in the file
    common.save("mqar_decisive.json", doc, verdicts=("verdicts", "overall"))
    p = common.plt()
    fig, axes = p.subplots(1, len(chosen), figsize=(7, 3.2), sharey=True)
    for ax, (P, a) in zip(axes, chosen.items()):
        for i, c in enumerate(a["cells"]):
            accs = [r["val_acc"] for r in rows if (r["P"], r["cell"]) == (P, c)]
            ax.scatter([i] * len(accs), accs, color=f"C{i}", zorder=3)
            ax.plot([i - 0.3, i + 0.3], [predicted[f"P{P}/{c}"]["ceiling"]] * 2, color="k", ls=":")
        ax.axhline(a["confirm"], color="g", lw=0.8)
        ax.axhline(a["refute"], color="r", lw=0.8)
        ax.set_xticks(range(len(a["cells"])), list(a["cells"]), fontsize=8)
        ax.set_title(f"P={P}, {a['iters']} iterations: {doc['verdicts'][str(P)].split(' (')[0].split(':')[0]}",
                     fontsize=8)
    axes[0].set_ylabel("val answer accuracy (dots: seeds)")
    fig.suptitle("pre-registered, 3 layers: green confirm, red refute, dotted the ceiling r + (1 - r)/P", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(common.out, "mqar_decisive.png"), dpi=120)


def table(doc):
    """Every cell of both arms: accuracy per seed, val loss, and the graph's predictions beside them."""
    lines = ["| arm | cell | iterations | val accuracy per seed | mean ± std | val loss (nats) "
             "| reachable in the graph | retrievable r | ceiling r + (1 − r)/P |", "|---" * 9 + "|"]
    for P, a in doc["arms"].items():
        for c in a["cells"]:
            rs = [r for r in doc["runs"] if (str(r["P"]), r["cell"]) == (P, c)]
            accs, losses = [r["val_acc"] for r in rs], [r["val_loss"] for r in rs]
            pr = doc["predicted"][f"P{P}/{c}"]
            lines.append(f"| P={P} | {c} | {a['iters']} | " + (", ".join(f"{x:.3f}" for x in accs) or "not run")
                         + f" | {mean_std(accs) if rs else '-'} | {mean_std(losses) if rs else '-'} | "
                         + " | ".join(f"{pr[k]:.3f}" for k in ("reachable", "retrievable", "ceiling")) + " |")
    return "\n".join(lines)


def summary(doc):
    return "\n".join([table(doc), ""] + [f"- arm P={P}: **{v}**" for P, v in doc["verdicts"].items()]
                     + [f"- overall: **{doc['overall']}**"])
