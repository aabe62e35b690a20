"""
Reproduce the paper in miniature on a CPU: every result of results/README.md. Each step runs the repo's own scripts
as subprocesses, printing every command, writes its JSON and plots into --out (default results/), and prints its
tables, rendered from that JSON (report.py). summary.md in --out collects the tables of every JSON there; with the
default --out the READMEs' rendered tables and verdicts follow the JSON too.

    python results/reproduce.py                       # the paper's claims: about 3 h on 2 quiet cores (estimated)
    python results/reproduce.py --only=mqar --train=False # the MQAR tables from the finished (or committed) runs
    python results/reproduce.py --only=lm1024         # plain LM, far copying at T=1024 (~22 CPU-hours)
    python results/reproduce.py --fast=True           # a tiny version of everything, about 5 minutes (tested in CI)
    python results/reproduce.py --only=demo --out=out-demo  # the class demo: SWA, SA+SWA and full on recall
    python results/reproduce.py --only=mqar,lm        # some of: figure, lm, swap, mqar, mqar_decisive, recall_swap,
                                                      # coverage, speed, lm1024; mqar_search, sa_rules, demo if named

A step per claim, each in its own file: recall.py (mqar_search, mqar, recall_swap), decisive.py (mqar_decisive),
lm.py (lm, swap), far_copy.py (lm1024), rules.py (sa_rules), demo.py (demo); figure, coverage and speed are here.
The default run's time is estimated from measured steps (never run as one invocation): the depth-2 MQAR grid
about 1.6 h, mqar_decisive 1.3 h, lm 11 minutes, swap 7, coverage 6, the rest a few.
"""
import os
import sys

import common
import decisive
import demo
import far_copy
import lm
import recall
import report
import rules
from provenance import provenance

ROOT = common.ROOT
# -----------------------------------------------------------------------------
fast = False            # tiny sizes everywhere: checks the pipeline, not the claims
only = ""               # comma list of experiments ("" = all)
out = os.path.join(ROOT, "results")  # JSON, PNG and summary.md go here
work = os.path.join(ROOT, "out-reproduce")  # data and checkpoints (not committed)
jobs = 2                # training runs in parallel, one thread each (2 cores: faster than 2 threads per run)
seeds = 3               # MQAR: train the first `seeds` seeds of each cell (a rerun with more keeps these)
depths = "2"            # MQAR: train these depths, comma list ("" = all: 2 and 4; this recipe cannot decide depth 4)
kinds = ""              # MQAR: train these cells (recall.CELLS), comma list ("" = the default grid)
arms = ""               # mqar_decisive: train these arms, comma list of P ("" = both); tables report every finished run
swap_T = "256"          # swap: the LM contexts, comma list; 256 swaps lm's model, another T trains its own model
train = True            # mqar, lm1024: False builds their tables from the finished runs only
names = ""              # lm1024: train only these runs, comma list of run names in this order ("" = every run)
demo_seeds = "0"        # demo: train these seeds of each kind, comma list
# -----------------------------------------------------------------------------
exec(open(os.path.join(ROOT, "configurator.py")).read())
common.fast, common.out, common.work, common.jobs = fast, out, work, jobs
EXTRA = {"sa_rules", "mqar_search", "demo"}  # run when named in --only (and in --fast): the value rule is ours, not the
# paper's; the search's result is committed (mqar_search.json), and leaving it out keeps the default run near 3 hours
COVER = ["--grid_n=256,1024", "--seeds=2"] if fast else []  # receptive_field.py's grid, smaller with --fast
SPEED = ["--sizes=256", "--kinds=full,swa,sa,moba", "--reps=1"] if fast else []  # bench.py's sizes, likewise


def figure():
    """The permutation picture: who sees whom under SWA, SA (in both orders) and SA+SWA."""
    import torch

    import attention
    T, w = 24, 3
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(3))
    panels = [("SWA (token order)", "token", attention.swa_mask(T, w)),
              ("SA in permuted order: a band,\ncausal on original positions", "slot",
               attention.swa_mask(T, w, pos=perm)),
              ("SA scattered back to token order", "token", attention.sa_mask(w, perm)),
              ("SA+SWA: local band + random shortcuts", "token", attention.swa_mask(T, w) | attention.sa_mask(w, perm))]
    p = common.plt()
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
    fig.savefig(os.path.join(common.out, "sa_picture.png"), dpi=80)


def coverage():
    """Receptive-field coverage (claim 1): receptive_field.py's grid, under SA's rank rule and its value rule."""
    common.run("results/receptive_field.py", "--grid=True", f"--json_out={os.path.join(out, 'coverage.json')}",
               f"--plot={os.path.join(out, 'coverage.png')}", *COVER)
    common.run("results/receptive_field.py", "--grid=True", "--sa_rule=value",
               f"--json_out={os.path.join(out, 'coverage_value.json')}", *COVER)


def speed():
    """Time and memory of every kind at T = 4096 and 16384 on this CPU (claim 7): bench.py."""
    common.run("results/bench.py", f"--json_out={os.path.join(out, 'speed_cpu.json')}", *SPEED)


if __name__ == "__main__":
    steps = dict(figure=figure, lm=lm.lm, swap=lambda: lm.swap(swap_T), mqar_search=recall.search,
                 mqar=lambda: recall.mqar(seeds, depths, kinds, train),
                 mqar_decisive=lambda: decisive.mqar_decisive(arms), recall_swap=recall.recall_swap,
                 coverage=coverage, speed=speed, sa_rules=rules.sa_rules, lm1024=lambda: far_copy.lm1024(names, train),
                 demo=lambda: demo.demo(demo_seeds))
    chosen = [s for s in only.split(",") if s] or [s for s in steps if fast or s not in EXTRA]
    unknown = set(chosen) - steps.keys()
    if unknown:
        sys.exit(f"--only: unknown experiment(s) {sorted(unknown)}; choose from {list(steps)}")
    provenance()  # the commit and command each row records, fixed before this run writes anything
    os.makedirs(out, exist_ok=True)
    for name in chosen:
        steps[name]()
        print(report.section(name, out), flush=True)  # its tables, rendered from the JSON it wrote
    report.write_summary(out)
    if not fast and os.path.realpath(out) == os.path.realpath(report.RESULTS):
        report.write_docs()  # README.md's and results/README.md's rendered tables and verdicts
