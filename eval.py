"""
Support, which a first reading skips. Evaluate a language model (ours, GPT-2 or a Hugging Face LM) without training:
perplexity, zero-shot tasks scored as lm-evaluation-harness 0.4.13 does, and attention swaps (swa, sa, moba have no
weights).

  python eval.py --out_dir=out-quick --tasks=ppl,lambada  # perplexity on the checkpoint's val.bin, LAMBADA (datasets)
  python eval.py --out_dir=out-quick --task_file=mine.jsonl  # a local JSONL task
  python eval.py --out_dir=out-full --attn=sa --window=64 --seeds=5  # a swap; SA as mean ± std over seeds
  python eval.py --init_from=Qwen/Qwen3-0.6B --dataset=wikitext-103 --split=test --windows=16,64 --json_out=q.json
"""
import json
import math
import os
import typing
from dataclasses import fields

import numpy as np
import torch
import torch.nn.functional as F

import attention
from checkpoint import (GPT2_META, GPT2_SIZES, from_gpt2, hf_tokenizer, hub_offline,
                        load_checkpoint)
from guards import InputError, need, path_problem, setting_problem
from hf import HFLM, padded_sa_draws
from model import ATTNS, BUILT, DTYPES, GPTConfig, autocast, swapped
from prepare_data import dataset_dir, get_tokenizer, load_meta, load_tokens, pyplot
from tasks import TASKS, Tokenizer, batch_logits, evaluate_task, load_task, load_task_file, task_name

# -----------------------------------------------------------------------------
init_from = "resume"  # resume (out_dir/ckpt.pt), gpt2[-medium|-large|-xl] or a Hugging Face LM (name or dir)
out_dir = "out"
data_root = ""  # datasets in data_root/<dataset>/ ("" = the checkpoint's, else data)
dataset = ""  # for perplexity ("" = the checkpoint's)
split = "val"  # its split (wikitext-103 also has test)
tasks = ""  # comma list of ppl, lambada, hellaswag, piqa, arc_easy, arc_challenge, winogrande ("" = ppl)
task_file = ""  # comma list of JSONL files, each a task named after it (no ppl unless in tasks)
limit = 0  # documents per task, block_size segments for ppl (0 = all)
attn = ""  # comma list of kinds of model.ATTNS to swap in ("" = the model's own; --windows: SWEEP)
# A swap's settings (None = the model's own), each given to the kinds that read it (READS); one
# that no kind of the run reads is refused
window: int | None = None  # swa's, sa's and sa+swa's keys per query; MoBA's budget of keys
windows = ""  # comma list of windows to sweep
moba_chunk: int | None = None  # MoBA's key chunk (None with a window: window // moba_topk)
moba_topk: int | None = None  # MoBA's chunks per query, its own included (Hugging Face: 4)
sa_draw: str | None = None  # "layer": one SA draw per layer; "head": one per batch row and head
sa_rule: str | None = None  # SA's rule: "rank" (the paper's) or "value" (a number r per token)
seeds = 1  # SA's permutation seeds 0..seeds-1: mean ± std
block_size: int | None = None  # context length cap (None = the model's own)
batch_size = 8
bootstrap_iters = 100000  # resamples for LAMBADA's ppl stderr, lm-eval's default (0 = none)
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
json_out = ""  # also write the results to this JSON file
plot = "sweep.png"  # a sweep's plot; a bare name goes beside --json_out if any, else in out_dir ("" = none)
SWAP_SETTINGS = ["window", "moba_chunk", "moba_topk", "sa_draw", "sa_rule"]  # the settings above
# any other GPTConfig field but BUILT's (the shape, dropout, RoPE) is a fork's new kind's own
# setting: a swap setting too, None = the model's own
for _field in fields(GPTConfig):
    if _field.name not in globals() and _field.name not in BUILT:
        globals()[_field.name], __annotations__[_field.name] = None, _field.type | None
        SWAP_SETTINGS.append(_field.name)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k[:1].islower() and isinstance(v, (int, float, str, type(None)))}
SWEEP = ("full", "swa", "sa", "moba")  # --windows without --attn: each kind that is one function
# The swap settings each kind reads (MoBA's window: its budget of keys, window // moba_topk per
# chunk); a fork's new kind is given every one, as eval.py cannot tell which it reads
READS = {"full": (), "swa": ("window",), "sa": ("window", "sa_draw", "sa_rule"),
         "sa+swa": ("window", "sa_draw", "sa_rule"), "moba": ("window", "moba_chunk", "moba_topk")}


def run(settings):
    """Evaluate per settings (overrides of DEFAULTS); print the tables, return the results."""
    s = {**DEFAULTS, **settings}
    ppl, names, files, kinds, ws, plot_path = check_settings(s)
    task_list = [load_task_file(f, s["limit"]) for f in files] + [load_task(t, s["limit"]) for t in names]
    lm, trained = load_model(s)
    swaps = plan(lm, kinds, ws, s)
    sa_rule = s["sa_rule"] or getattr(lm.model.config, "sa_rule", "rank")  # Hugging Face: rank
    print(attention.engine_line(s["device"], DTYPES[s["dtype"]], lm.head_dim,
                                [(swap or lm.native)["attn"] for swap in swaps], sa_rule))
    ppl_name, tokens = perplexity_tokens(s, lm, trained) if ppl else (None, None)
    rows, bs = [], s["batch_size"]
    for swap in swaps:
        if swap:
            lm.use(swap)
        label = swap or lm.native
        for seed in range(s["seeds"] if label["attn"] in ("sa", "sa+swa") else 1):  # SA's kinds
            lm.seed(seed)
            found = {} if tokens is None else {ppl_name: perplexity(lm, tokens, bs, s["limit"])}
            found.update({n: evaluate_task(lm, n, k, docs, bs, s["bootstrap_iters"]) for n, k, docs in task_list})
            rows += [{"attn": label["attn"], "window": label.get("window"), "seed": seed, "task": t, "metric": m,
                      "value": v, "stderr": e} for t, ms in found.items() for m, (v, e) in ms.items()]
    results = aggregate(rows)
    print(table(results))
    ws, panels = sweep_cells(results)
    try:
        if len(ws) > 1:
            print(sweep_tables(ws, panels))
            if plot_path:
                plot_sweep(ws, panels, plot_path)
        if s["json_out"]:
            os.makedirs(os.path.dirname(s["json_out"]) or ".", exist_ok=True)
            with open(s["json_out"], "w") as f:
                json.dump({"settings": s, "results": results, "per_seed": rows}, f, indent=1)
    except OSError as e:  # a full disk
        raise InputError(f"cannot write {e.filename or s['json_out']}: {e.strerror or e} (the tables above are "
                         "complete)") from None
    return results


def check_settings(s):
    """(ppl?, tasks, task files, kinds, windows, plot path), checked before anything loads: run() may get any dict."""
    for k, v in s.items():
        need(k in DEFAULTS, f"{k}={v!r}: eval.py has no such setting")
        problem = setting_problem(k, v, s)
        types = typing.get_args(__annotations__[k]) if k in __annotations__ else (type(DEFAULTS[k]),)  # X | None
        need(problem is None and type(v) in types, f"{k}={v!r}: {problem or 'its type'}")
    repeat = lambda xs: next((x for i, x in enumerate(xs) if x in xs[:i]), None)  # noqa: E731

    def items(name, parse=str, known=None):
        try:
            got = [parse(x.strip()) for x in s[name].split(",") if x.strip()]
        except ValueError:
            raise InputError(f"{name}={s[name]!r}: use a comma list of integers") from None
        dup, unknown = repeat(got), next((x for x in got if known and x not in known), None)
        need(dup is None, f"{name}={s[name]!r}: lists {dup!r} twice: give each once")
        need(unknown is None, f"{name}={s[name]!r}: unknown {unknown!r}: choose from {', '.join(known or ())}")
        return got
    names, files = items("tasks", known=("ppl", *TASKS)), items("task_file")
    kinds, ws = items("attn", known=ATTNS), items("windows", int)
    tasks = [t for t in names if t != "ppl"]
    clash = repeat(tasks + [task_name(f) for f in files])  # results are keyed by task name
    need(clash is None, f"task_file={s['task_file']!r}: two tasks are named {clash!r} (a task is named after its file)")
    need(all(w >= 1 for w in ws), f"windows={s['windows']!r}: use integers >= 1")
    empty = next((n for n in SWAP_SETTINGS if s[n] == ""), None)  # "" is no value, never read
    need(empty is None, f"{empty}='': give it a value, or leave it out for the model's own")
    if s["window"] is not None:
        need(not ws, "give --window or --windows, not both")
        ws = [s["window"]]
    plot_path = s["plot"] and os.path.join(
        "" if os.path.dirname(s["plot"]) else os.path.dirname(s["json_out"]) or s["out_dir"], s["plot"])
    problem = plot_path and len(ws) > 1 and path_problem(plot_path, is_file=True)
    need(not problem, f"plot={s['plot']!r}: {problem}")
    return "ppl" in names or not (names or files), tasks, files, kinds, ws, plot_path


def plan(lm, kinds, ws, s):
    """[None] (the model as is) or a list of lm.use() kwargs, one per swap: full once, each other
    kind once per window, with the settings of s that it reads (READS). Without --attn, several
    windows sweep SWEEP (an sa+swa model keeps its kind: model.swapped), and any other setting swaps
    the model's own kind. A setting that no kind of the run reads is refused, and so is --seeds
    without SA: each would do nothing."""
    native = lm.native["attn"]
    given = [n for n in SWAP_SETTINGS if n != "window" and s[n] is not None] + ["window"] * bool(ws)
    swap_kinds = kinds or (list(SWEEP) if len(ws) > 1 and native != "sa+swa" else [native])
    if kinds:
        where = f"--attn={s['attn']}"
    elif len(swap_kinds) == 1:
        where = f"this model's own attention, {native}"
    else:
        where = f"the sweep's {', '.join(swap_kinds)}"
    for n in given:
        readers = [k for k in ATTNS if n in READS.get(k, SWAP_SETTINGS)]  # a fork's kind: all
        name, value = ("windows", s["windows"]) if n == "window" and s["windows"] else (n, s[n])
        need(set(readers) & set(swap_kinds), f"{name}={value!r} does nothing on {where}: drop it, "
             f"or swap in a kind that reads it (--attn={','.join(readers)})")
    need(s["seeds"] == 1 or {"sa", "sa+swa"} & set(swap_kinds), f"seeds={s['seeds']} does nothing "
         f"on {where}: only SA draws; drop it, or swap SA in (--attn=sa)")
    if not kinds and not given:
        return [None]
    if not ws and set(swap_kinds) - {"full", "moba"}:  # swa, sa, sa+swa, a fork's kind: a window
        need("window" in lm.native, f"--attn={s['attn'] or native} on this model needs --window or "
             "--windows")
        ws = [lm.native["window"]]
    own_topk = lm.own.moba_topk if isinstance(lm, OurLM) else GPTConfig.moba_topk  # Hugging Face: 4
    swaps = []
    for k in swap_kinds:
        reads = READS.get(k, SWAP_SETTINGS)
        for w in ws if "window" in reads and ws else [None]:  # None: full, or MoBA by its chunk
            swap = {"attn": k, **{n: s[n] for n in reads if n != "window" and s[n] is not None}}
            if w is not None:
                swap["window"] = w
            if k == "moba" and s["moba_chunk"] is None and w is not None:  # w keys, in chunks
                swap["moba_chunk"] = max(1, w // (s["moba_topk"] or own_topk))
            need(k != "moba" or "moba_chunk" in swap or isinstance(lm, OurLM), "--attn=moba on "
                 "this model needs --moba_chunk, --window or --windows")
            swaps.append(swap)
    for swap in swaps if isinstance(lm, OurLM) else []:  # all checked before the first runs
        swapped(lm.own, **swap)
    return swaps


# A model (OurLM; hf.HFLM for transformers) has tok (a Tokenizer), block_size, head_dim, device,
# native (its own attention: its kind, and its window if the kind reads one), logits(idx, lengths),
# use(swap), seed(s). lengths (B,): each right-padded row's real tokens, which alone SA permutes:
# padding never changes a score (batch_size changes SA's draws).

class OurLM:  # our GPT: a checkpoint or GPT-2

    def __init__(self, model, tok, block_size, device, ctx):
        self.model, self.tok, self.device, self.ctx, c = model.eval(), tok, device, ctx, model.config
        self.block_size, self.head_dim = min(block_size or c.block_size, c.block_size), c.n_embd // c.n_head
        self.seed, self.own = model.seed_sa, c  # own: the model's config, where each swap starts
        self.native = {"attn": c.attn}
        if c.attn not in ("full", "moba"):  # swa, sa, sa+swa and a fork's kind read a window
            self.native["window"] = c.window

    def logits(self, idx, lengths=None):
        """idx (B, T) -> logits (B, T, vocab); lengths (B,): the real tokens of each right-padded
        row, which alone SA permutes (hf.padded_sa_draws)."""
        draws = None if lengths is None else padded_sa_draws(self.model, idx, lengths)
        with self.ctx:
            return self.model(idx, draws=draws)[0]  # (B, T, vocab)

    def use(self, swap):
        """Swap in swap's kind and settings, the others the model's own (not a former swap's)."""
        self.model.config = self.own
        self.model.swap_attention(**swap)


def load_model(s):
    """(lm, the settings it was trained with: a checkpoint's, else {})."""
    dev, name, ctx = s["device"], s["init_from"], autocast(s["device"], s["dtype"])

    def ours(model, meta, source):  # our GPT with meta's tokenizer
        encode, decode = get_tokenizer(meta, source)
        return OurLM(model, Tokenizer(meta["tokenizer"], encode, decode, meta.get("eot"), encode), s["block_size"],
                     dev, ctx)
    if name == "resume":
        model, ckpt = load_checkpoint(path := os.path.join(s["out_dir"], "ckpt.pt"), dev, require=("meta", "settings"))
        return ours(model, ckpt["meta"], path), ckpt["settings"]
    need(not os.path.isdir(name) or os.path.isfile(os.path.join(name, "config.json")), f"--init_from={name}: the "
         f"directory holds no model (no config.json); a train.py out_dir: --init_from=resume --out_dir={name}")
    offline = hub_offline(name)
    try:
        if name in GPT2_SIZES:
            return ours(from_gpt2(name).to(dev), GPT2_META, name), {}
        hf_tok = hf_tokenizer(name)  # one line without transformers, or in a directory without one
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[s["dtype"]]).to(dev)
    except OSError as e:  # not on the hub, not in the cache, or offline
        why = "the Hugging Face hub is unreachable and it is not in the local cache" if offline else \
            str(e).splitlines()[0][:200]
        raise InputError(f"--init_from={name}: cannot load it ({why}); go online once, or give a local path") from None
    prefix = hf_tok.bos_token_id if hf_tok.bos_token_id is not None else hf_tok.eos_token_id  # lm-eval's prefix token
    prefix_text = hf_tok.decode(prefix) if prefix is not None else None
    tok = Tokenizer(f"hf:{name}", lambda t: hf_tok.encode(t, add_special_tokens=False), hf_tok.decode, prefix,
                    # lm-eval's tok_encode: the tokenizer's defaults, unless the text starts with the prefix token
                    lambda t: hf_tok.encode(t, add_special_tokens=not (prefix_text and t.startswith(prefix_text))))
    return HFLM(model, tok, s["block_size"], dev, hf_tok.model_max_length), {}


# Perplexity

@torch.no_grad()
def perplexity(lm, tokens, batch_size, limit=0):
    """{metric: (value, None)}, no stderr as in lm-eval: loss, ppl and bpb (bits per UTF-8 byte; none for ids) of
    `tokens`, each but the first predicted once, in segments of T = block_size."""
    T = lm.block_size
    starts = list(range(0, len(tokens) - 1, T))[:limit or None]
    need(starts, f"perplexity needs at least 2 tokens, got {len(tokens)}")
    n, nll = min(starts[-1] + T, len(tokens) - 1), 0.0  # tokens 1..n are predicted
    segments = [tokens[s:min(s + T, n) + 1] for s in starts]
    for i, logits in batch_logits(lm, [seg[:-1] for seg in segments], batch_size, "ppl"):
        y = torch.from_numpy(np.asarray(segments[i][1:], dtype=np.int64)).to(logits.device)
        nll += F.cross_entropy(logits.float(), y, reduction="sum").item()  # fp32 one row at a time, not a batch
    out = {"loss": nll / n, "ppl": math.exp(nll / n)}
    if lm.tok.name != "ids":
        n_bytes = n if lm.tok.name == "bytes" else len(lm.tok.decode(tokens[1:n + 1].tolist()).encode("utf-8"))
        out["bpb"] = nll / math.log(2) / n_bytes
    return {k: (v, None) for k, v in out.items()}


def perplexity_tokens(s, lm, trained):
    """(dataset/split, its tokens in lm's tokenizer); by default lm's training data."""
    name = s["dataset"] or trained.get("dataset", "")
    need(name, "perplexity needs --dataset=NAME, a dataset made by prepare_data.py (e.g. wikitext-103)")
    data_dir = dataset_dir(s["data_root"] or trained.get("data_root") or "data", name)
    meta = load_meta(data_dir)
    tokens, label = load_tokens(data_dir, s["split"], meta), f"{name}/{s['split']}"
    if meta["tokenizer"] == lm.tok.name:
        return label, tokens
    need(meta["tokenizer"] != "ids", f"dataset {name} is bare token ids: only a model trained on it reads it")
    return label, np.array(lm.tok.encode(get_tokenizer(meta, data_dir)[1](tokens.tolist())), dtype=np.int64)


# Reporting

def aggregate(rows):
    """Per (attn, window, task, metric): the mean over seeds, its seed_std, the mean stderr."""
    by, groups, out = ("attn", "window", "task", "metric"), {}, []
    for r in rows:
        groups.setdefault(tuple(r[k] for k in by), []).append(r)
    for group, rs in groups.items():
        v, e = [r["value"] for r in rs], [r["stderr"] for r in rs if r["stderr"] is not None]
        out.append({**dict(zip(by, group)), "value": float(np.mean(v)), "stderr": float(np.mean(e)) if e else None,
                    "seed_std": float(np.std(v, ddof=1)) if len(v) > 1 else None, "seeds": len(v)})
    return out


def fmt(x):
    return "-" if x is None else f"{x:.4f}"


def table(results):
    rows = [("attn", "window", "task", "metric", "value", "stderr", "seed std")] + [
        (r["attn"], str(r["window"] or "-"), r["task"], r["metric"], fmt(r["value"]), fmt(r["stderr"]),
         fmt(r["seed_std"])) for r in results]
    widths = [max(map(len, column)) for column in zip(*rows)]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows)


def sweep_cells(results):
    """(windows, [(task, metric, {kind: its result per window})]), metric: acc, else ppl; full has one for all."""
    ws, out = sorted({r["window"] for r in results if r["attn"] != "full"}), []
    for task in dict.fromkeys(r["task"] for r in results):
        metric = "acc" if any((r["task"], r["metric"]) == (task, "acc") for r in results) else "ppl"
        got = {(r["attn"], r["window"]): r for r in results if (r["task"], r["metric"]) == (task, metric)}
        out.append((task, metric, {k: [got[k, None if k == "full" else w] for w in ws] for k, _ in got}))
    return ws, out


def sweep_tables(ws, panels):
    """Per task, kind x window: mean ± std over seeds."""
    lines = []
    for task, metric, cells in panels:
        lines += [f"\n{task} {metric}", "attn".ljust(8) + "".join(f"{w:>18}" for w in ws)]
        for kind, rs in cells.items():
            shown = [fmt(r["value"]) + ("" if r["seed_std"] is None else " ± " + fmt(r["seed_std"])) for r in rs]
            lines.append(kind.ljust(8) + "".join(f"{c:>18}" for c in shown))
    return "\n".join(lines)


def window_ticks(ax, ws):
    """A log x axis labelled at the windows only: log scale's own minor labels overlap."""
    ax.set_xscale("log")
    ax.xaxis.minorticks_off()
    ax.set_xticks(ws, [str(w) for w in ws])


def plot_sweep(ws, panels, path):
    try:
        plt = pyplot("the sweep's plot")
    except ValueError as e:  # no matplotlib: the tables are the result
        return print(f"({e})")
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (task, metric, cells) in zip(axes[0], panels):
        for kind, rs in cells.items():
            if kind == "full":
                ax.axhline(rs[0]["value"], color="gray", ls="--", lw=1, label="full")
            else:
                ax.errorbar(ws, [r["value"] for r in rs], yerr=[r["seed_std"] or 0 for r in rs], marker="o", label=kind)
        window_ticks(ax, ws)
        ax.set(xlabel="window", title=f"{task} {metric}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved {path}")


if __name__ == "__main__":
    exec(open("configurator.py").read())
    run({k: globals()[k] for k in setting_names})  # an InputError is one line (guards.one_line)
