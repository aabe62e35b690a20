"""
What every step of results/reproduce.py shares: where it writes (out) and trains (work), running the repo's scripts
as subprocesses, training runs two at a time, reading their logs, and writing a results JSON whose every row records
the commit and command it comes from (provenance.py). reproduce.py sets fast, out, work and jobs from its settings.
"""
import json
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

fast = False                                # tiny sizes everywhere: checks the pipeline, not the claims
out = os.path.join(ROOT, "results")         # JSON, PNG and summary.md go here
work = os.path.join(ROOT, "out-reproduce")  # data and checkpoints (not committed)
jobs = 2                                    # training runs at a time, one thread each


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
        settings = (f"--{k}={v}" for k, v in args.items() if k != "presets")
        run("train.py", *args["presets"], f"--out_dir={out_dir}", *settings,
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


def committed(name):
    """The committed out/NAME (the runs of a machine whose checkpoints are gone), or {}."""
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else {}


def save(name, obj, verdicts=()):
    """Writes out/NAME, each row with the commit and command it comes from (provenance.stamp), and each verdict (the
    top-level keys named in verdicts) with the same in verdict_provenance: a verdict the committed file already holds
    keeps the commit and command it came from, a changed one gets this run's."""
    old = committed(name)
    obj, known = json.loads(json.dumps(obj)), list(result_rows(old))
    if verdicts:
        kept = old.get("verdict_provenance", {})
        obj["verdict_provenance"] = {k: kept[k] if k in kept and old.get(k) == obj[k] else provenance()
                                     for k in verdicts}
    for row in result_rows(obj):
        stamp(row, known)
    os.makedirs(out, exist_ok=True)
    write_json(obj, os.path.join(out, name))


def to_json(doc):
    """A results JSON as text, a line per top-level key, and a line per row (or per item of any list or dict of lists
    and dicts): a table that reads, and diffs, a row at a time. json.dumps writes each float as its repr: read back,
    every number is the one written."""
    def block(x):  # a list or dict that holds lists or dicts: an item a line; anything else: one line
        items = list(x.items()) if isinstance(x, dict) else list(enumerate(x)) if isinstance(x, list) else []
        if not any(isinstance(v, (dict, list)) for _, v in items):
            return json.dumps(x)
        lines = [f"{json.dumps(k)}: {json.dumps(v)}" if isinstance(x, dict) else json.dumps(v) for k, v in items]
        first, last = "{}" if isinstance(x, dict) else "[]"
        return first + "\n  " + ",\n  ".join(lines) + "\n " + last
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {block(v)}" for k, v in doc.items()) + "\n}"


def write_json(obj, path):
    with open(path, "w") as f:
        f.write(to_json(obj) + "\n")


def seeds_where(seeds, flags):
    """The seeds whose flag is set: 'every seed', 'seed 2 only', 'seeds 0 and 2 only' or 'no seed'."""
    hit = [str(s) for s, f in zip(seeds, flags) if f]
    return "every seed" if len(hit) == len(flags) else \
        f"seed{'s' * (len(hit) > 1)} {' and '.join(hit)} only" if hit else "no seed"


def mean_std(xs):
    return f"{statistics.mean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def plt():
    try:
        return pyplot("results/reproduce.py's plots")
    except ValueError as e:
        sys.exit(str(e))
