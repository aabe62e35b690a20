"""
Zero-shot tasks for eval.py: loading them and scoring them the way EleutherAI's
lm-evaluation-harness 0.4.13 does (each scoring function says which part of lm-eval it follows).

A task is (name, kind, docs), kind one of
  "choice"   {"context": str, "choices": [str, ...], "label": int}
  "partial"  {"contexts": [str, ...], "continuation": str, "label": int}   (WinoGrande)
  "lambada"  {"text": str}
A model is anything with tok (a Tokenizer), block_size, device and logits(idx, lengths).
"""
import json
import math
import os
import random
import re
from collections import namedtuple

import numpy as np
import torch

from prepare_data import progress

# name: "bytes", "gpt2", "hf:<model>", ...; encode: text alone, no special tokens; encode_default: with the
# tokenizer's default special tokens (BOS for Llama, Gemma, ...), as lm-eval encodes contexts; eot: the
# token an empty context is scored after (BOS, else EOS, for a Hugging Face tokenizer: lm-eval's prefix token)
Tokenizer = namedtuple("Tokenizer", "name encode decode eot encode_default")

FIELDS = {"choice": ("context", "choices", "label"), "partial": ("contexts", "continuation", "label"),
          "lambada": ("text",)}


def hellaswag_clean(text):
    """The harness's HellaSwag preprocessing: WikiHow's bracketed artifacts out."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_doc(d):
    ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
    return {"context": hellaswag_clean(d["activity_label"] + ": " + ctx),
            "choices": [hellaswag_clean(e) for e in d["endings"]], "label": int(d["label"])}


def arc_doc(d):
    return {"context": f"Question: {d['question']}\nAnswer:", "choices": d["choices"]["text"],
            "label": d["choices"]["label"].index(d["answerKey"])}


def winogrande_doc(d):
    i = d["sentence"].index("_")  # the blank: each option fills it, the rest of the sentence is scored
    return {"contexts": [d["sentence"][:i] + o for o in (d["option1"], d["option2"])],
            "continuation": d["sentence"][i + 1:].strip(), "label": int(d["answer"]) - 1}


# name: (Hugging Face dataset, its config, split, row -> doc), as lm-evaluation-harness loads and formats them
TASKS = {
    "lambada": ("EleutherAI/lambada_openai", "default", "test", lambda d: {"text": d["text"]}),
    "hellaswag": ("Rowan/hellaswag", None, "validation", hellaswag_doc),
    "piqa": ("baber/piqa", None, "validation",
             lambda d: {"context": f"Question: {d['goal']}\nAnswer:", "choices": [d["sol1"], d["sol2"]],
                        "label": int(d["label"])}),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", arc_doc),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", arc_doc),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", winogrande_doc),
}


def doc_kind(doc):
    """The kind of one doc, or a ValueError that says what is wrong with it."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    kinds = [k for k, f in FIELDS.items() if f[0] in doc]
    if len(kinds) != 1:
        raise ValueError('expected {"context", "choices", "label"} (multiple choice), '
                         '{"contexts", "continuation", "label"} (partial scoring) or {"text"} (LAMBADA-style)')
    kind = kinds[0]
    missing = [f for f in FIELDS[kind] if f not in doc]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if kind == "lambada":
        if not isinstance(doc["text"], str) or len(doc["text"].split(" ")) < 2:
            raise ValueError('"text" must be a string of at least two words (the last one is the target)')
        return kind
    options, text = (doc["choices"], doc["context"]) if kind == "choice" else (doc["contexts"], doc["continuation"])
    if not (isinstance(options, list) and len(options) >= 2 and all(isinstance(o, str) and o for o in options)):
        raise ValueError(f'"{"choices" if kind == "choice" else "contexts"}" must be a list of at least two '
                         'non-empty strings')
    if not isinstance(text, str):
        raise ValueError(f'"{"context" if kind == "choice" else "continuation"}" must be a string')
    label = doc["label"]
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
        raise ValueError(f'"label" must be an integer index into the {len(options)} options, got {label!r}')
    return kind


def task_name(path):
    """A task file's task is named after the file: mine.jsonl is the task "mine"."""
    return os.path.splitext(os.path.basename(path))[0]


def load_task_file(path, limit=0):
    """(task_name(path), kind, docs) from a JSONL file of UTF-8 text: one doc per line, all of one kind."""
    if not os.path.isfile(path):
        raise ValueError(f"task file {path} not found")
    if not (type(limit) is int and limit >= 0):
        raise ValueError(f"limit={limit!r}: use an integer >= 0 (0: every document)")
    docs, kind = [], None
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named like any other bad line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                                 "save it as UTF-8") from None
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                k = doc_kind(doc)
            except ValueError as e:  # json's errors are ValueErrors too
                raise ValueError(f"{path}:{lineno}: malformed task line: {e}") from None
            if kind not in (None, k):
                raise ValueError(f"{path}:{lineno}: a {k} line in a file of {kind} lines: one kind per file")
            kind = k
            docs.append(doc)
    if not docs:
        raise ValueError(f"task file {path} has no documents")
    return task_name(path), kind, docs[:limit or None]


def load_task(name, limit=0):
    """(name, kind, docs) of a known task, through the `datasets` package."""
    path, config, split, convert = TASKS[name]
    try:
        import datasets
    except ImportError:
        raise ValueError(f"task {name} is downloaded with the `datasets` package: pip install datasets, "
                         "or pass the task as --task_file=FILE.jsonl") from None
    try:
        rows = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline shows up as several exception types
        raise ValueError(f"could not load {path} for task {name} ({type(e).__name__}: {str(e)[:200]}); "
                         "offline? pass it as --task_file=FILE.jsonl") from None
    docs = [convert(row) for row in (rows.select(range(min(limit, len(rows)))) if limit else rows)]
    return name, doc_kind(docs[0]), docs


# -----------------------------------------------------------------------------
# Scoring

def encode_pair(tok, context, continuation):
    """Token ids of (context, continuation), lm-eval's split: the context's trailing spaces move to
    the continuation; the context is encoded alone and the continuation is what context +
    continuation adds to it, both with the tokenizer's default special tokens. A context that is
    empty, or whitespace only, is the end-of-text token (lm-eval asserts on the latter)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        if tok.eot is None:
            raise ValueError(f"an empty context is scored after the end-of-text token, "
                             f"which the {tok.name} tokenizer lacks")
        cont = tok.encode(continuation)
        return ([tok.eot], cont) if cont[:1] != [tok.eot] else (cont[:1], cont[1:])
    whole, ctx = tok.encode_default(context + continuation), tok.encode_default(context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihoods(lm, requests, batch_size, desc="score"):
    """[(log-likelihood of the continuation, every continuation token the greedy argmax)] per
    (context, continuation) request, the harness's loglikelihood."""
    items = []
    for context, continuation in requests:
        ctx, cont = encode_pair(lm.tok, context, continuation)
        if not 1 <= len(cont) <= lm.block_size:
            raise ValueError(f"continuation {continuation!r} is {len(cont)} tokens: "
                             f"it must fit in 1..block_size={lm.block_size}")
        items.append(((ctx + cont)[-(lm.block_size + 1):-1], cont))  # the input, left-truncated to block_size
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # longest first: little padding
    out = [None] * len(items)
    batches = range(0, len(order), batch_size)
    for b in progress(batches, desc=desc, total=len(batches), leave=False):
        batch = order[b:b + batch_size]
        lengths = torch.tensor([len(items[i][0]) for i in batch])
        x = torch.zeros(len(batch), int(lengths[0]), dtype=torch.long)           # (B, T), right-padded
        for r, i in enumerate(batch):
            x[r, :lengths[r]] = torch.tensor(items[i][0])
        logits = lm.logits(x.to(lm.device), lengths)                             # (B, T, vocab)
        for r, i in enumerate(batch):
            inp, cont = items[i]
            logp = logits[r, len(inp) - len(cont):len(inp)].float().log_softmax(-1)  # (n, vocab): predicts cont
            target = torch.tensor(cont, device=logp.device)
            ll = logp.gather(-1, target[:, None]).sum().item()                      # (n, 1) summed
            out[i] = (ll, bool((logp.argmax(-1) == target).all()))
    return out


def mean_stderr(xs):
    """(mean, sample std / sqrt(n)): the harness's mean and mean_stderr."""
    n = len(xs)
    if n == 0:
        raise ValueError("mean_stderr of no values: the task has no documents")
    return float(np.mean(xs)), (float(np.std(xs, ddof=1) / math.sqrt(n)) if n > 1 else None)


def bootstrap_stderr(f, xs, iters):
    """lm-eval's bootstrap_stderr: the sample std of f over `iters` resamples of xs, drawn in chunks
    of 1000, chunk i by random.Random(i).choices(xs, k=n), i.e. xs[floor(random() * n)]. numpy
    replays that Mersenne Twister stream, vectorised; f maps (chunk, n) resamples to (chunk,)."""
    xs, n, chunk = np.asarray(xs, dtype=np.float64), len(xs), min(1000, iters)
    if n < 2 or iters < 1:
        return None
    res = []
    for i in range(iters // chunk):
        state = random.Random(i).getstate()[1]                                   # 624 words, then a position
        rng = np.random.RandomState()
        rng.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
        res.append(f(xs[np.floor(rng.random_sample((chunk, n)) * n).astype(np.int64)]))  # (chunk, n) -> (chunk,)
    return float(np.std(np.concatenate(res), ddof=1))


def requests_of(kind, doc):
    if kind == "lambada":
        words = doc["text"].split(" ")
        return [(" ".join(words[:-1]), " " + words[-1])]
    if kind == "choice":
        return [(doc["context"], " " + c) for c in doc["choices"]]
    return [(c, " " + doc["continuation"]) for c in doc["contexts"]]


def evaluate_task(lm, name, kind, docs, batch_size, bootstrap_iters=100000):
    """{metric: (value, stderr)} of one task. Multiple choice: acc is the argmax of the log-likelihoods of
    " " + choice after the context, acc_norm the argmax of each over len(choice) in characters; partial scoring
    (WinoGrande) fills the blank with each option and scores the rest of the sentence, acc only. LAMBADA: acc
    counts a document whose every target token is the greedy argmax, ppl = exp(-mean target log-likelihood)."""
    reqs = [requests_of(kind, d) for d in docs]
    flat = loglikelihoods(lm, [r for rs in reqs for r in rs], batch_size, desc=name)
    if kind == "lambada":
        lls = [ll for ll, _ in flat]
        return {"acc": mean_stderr([float(greedy) for _, greedy in flat]),
                "ppl": (math.exp(-np.mean(lls)), bootstrap_stderr(lambda s: np.exp(-s.mean(-1)), lls, bootstrap_iters))}
    acc, acc_norm, start = [], [], 0
    for d, rs in zip(docs, reqs):
        lls = np.array([ll for ll, _ in flat[start:start + len(rs)]])
        start += len(rs)
        acc.append(float(np.argmax(lls) == d["label"]))
        if kind == "choice":
            acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in d["choices"]])) == d["label"]))
    return {"acc": mean_stderr(acc), **({"acc_norm": mean_stderr(acc_norm)} if acc_norm else {})}
