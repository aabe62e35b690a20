"""
SA's two rules at the same budget and seeds: rank (the paper's: permuted slots) and value (ours: a random number per
token, so that a KV cache decodes it exactly; attention.py's docstring). Step sa_rules of results/reproduce.py, run
only when named: the LM runs of lm.py, and recall on an ordered layout, for sa and sa+swa.
"""
import os
import statistics

import common
import lm
import recall
from common import evals, mean_std, train_all

# The rules' recall comparison ran on the ordered layout (every answer 63 tokens back) with the recipe
# config/mqar.py had then; pinned here, so that the step reruns what sa_rules.json holds.
RULES_RECALL_DATA = ["--mqar_seq_len=128", "--mqar_num_pairs=32", "--mqar_num_queries=32", "--mqar_vocab=256",
                     "--mqar_ordered=True"]
RULES_RECALL = dict(block_size=128, n_head=2, n_embd=128, window=8, moba_chunk=2, moba_topk=4, learning_rate=3e-3,
                    decay_lr=True, warmup_iters=50, min_lr=3e-4, n_layer=2)


def sa_rules():
    """Rank against value, for sa and sa+swa, on the LM and on recall. Trained afresh, each rank run next to its value
    twin (at the same time with jobs=2), so that their wall times share the machine's load."""
    size, recall_size = lm.sizes(), recall.sizes()
    lm_data, recall_data = lm.data(), os.path.join(common.work, "data-ordered")
    common.run("prepare_data.py", "--dataset=mqar", f"--data_root={recall_data}", *RULES_RECALL_DATA,
               *recall_size["data"])
    recall_iters = 8 if common.fast else 300
    setups = dict(lm=dict(presets=["config/quick.py"], data_root=lm_data, max_iters=size["iters"],
                          eval_interval=size["eval_interval"], **size["extra"]),
                  recall=dict(presets=["config/mqar.py", *recall_size["train"]], data_root=recall_data, **RULES_RECALL,
                              max_iters=recall_iters, eval_interval=recall_iters // 4))
    rules, sa_kinds = ["rank", "value"], ["sa", "sa+swa"]
    runs = [(t, k, r, s) for t in setups for s in size["seeds"] for k in sa_kinds for r in rules]  # LM first
    dirs = [os.path.join(common.work, f"rules-{t}-{k}-{r}-s{s}") for t, k, r, s in runs]
    train_all([(od, dict(setups[t], attn=k, sa_rule=r, seed=s)) for (t, k, r, s), od in zip(runs, dirs)])
    rows = []
    for (task, kind, rule, seed), od in zip(runs, dirs):
        last = evals(od)[-1]
        rows.append(dict(task=task, attn=kind, sa_rule=rule, seed=seed, val_loss=last["val_loss"],
                         **({"val_acc": last["val_acc"]} if task == "recall" else {}),
                         wall_s=last["elapsed_s"]))
    common.save("sa_rules.json", dict(setups={t: {k: v for k, v in a.items() if k != "data_root"}
                                              for t, a in setups.items()}, recall_data=RULES_RECALL_DATA, runs=rows))


def summary(doc):
    """Rank against value per task and kind: mean ± std over seeds, their difference, the wall time per run."""
    metric, rows = dict(lm="val_loss", recall="val_acc"), doc["runs"]
    cell = lambda t, k, r, field: [x[field] for x in rows if (x["task"], x["attn"], x["sa_rule"]) == (t, k, r)]  # noqa
    lines = ["| task: metric | attn | rank | value | value − rank | seeds | wall time per run: rank, value |",
             "|---|---|---|---|---|---|---|"]
    for t in doc["setups"]:
        for k in ("sa", "sa+swa"):
            rank, value = (cell(t, k, r, metric[t]) for r in ("rank", "value"))
            lines.append(f"| {t}: {metric[t]} | {k} | {mean_std(rank)} | {mean_std(value)} "
                         f"| {statistics.mean(value) - statistics.mean(rank):+.3f} | {len(rank)} "
                         f"| {statistics.mean(cell(t, k, 'rank', 'wall_s')):.0f} s, "
                         f"{statistics.mean(cell(t, k, 'value', 'wall_s')):.0f} s |")
    return "\n".join(lines)
