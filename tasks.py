"""
Support, which a first reading skips: eval.py's zero-shot tasks, loaded and scored as lm-evaluation-harness 0.4.13
loads and scores them, and a model's logits in right-padded batches.
"""
import json
import math
import os
import random
import re
from collections import namedtuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from guards import InputError, count, need
from prepare_data import hf_dataset, progress

# Zero-shot tasks as lm-eval loads them, a doc holding its scoring's FIELDS (partial: WinoGrande's).
# Tokenizer.encode adds no special tokens, encode_default the default ones (Llama's BOS...) as lm-eval encodes
# contexts; eot: an empty context's token; name: "bytes", "gpt2", "hf:<model>"...
Tokenizer = namedtuple("Tokenizer", "name encode decode eot encode_default")
FIELDS = {"choice": ("context", "choices", "label"), "partial": ("contexts", "continuation", "label"),
          "lambada": ("text",)}


def hellaswag_clean(text):  # the harness's: WikiHow's bracketed artifacts out
    return re.sub("\\[.*?\\]", "", text.strip().replace(" [title]", ". ")).replace("  ", " ")


def hellaswag_doc(d):
    return {"context": hellaswag_clean(d["activity_label"] + ": " + d["ctx_a"] + " " + d["ctx_b"].capitalize()),
            "choices": [hellaswag_clean(e) for e in d["endings"]], "label": int(d["label"])}


def arc_doc(d):
    return {"context": f"Question: {d['question']}\nAnswer:", "choices": d["choices"]["text"],
            "label": d["choices"]["label"].index(d["answerKey"])}


def piqa_doc(d):
    return {"context": f"Question: {d['goal']}\nAnswer:", "choices": [d["sol1"], d["sol2"]], "label": int(d["label"])}


def winogrande_doc(d):
    i = d["sentence"].index("_")  # the blank: each option fills it, the rest of the sentence is scored
    return {"contexts": [d["sentence"][:i] + o for o in (d["option1"], d["option2"])],
            "continuation": d["sentence"][i + 1:].strip(), "label": int(d["answer"]) - 1}


TASKS = {  # name: (Hugging Face dataset, its subset, split, row -> doc)
    "lambada": ("EleutherAI/lambada_openai", "default", "test", lambda d: {"text": d["text"]}),
    "hellaswag": ("Rowan/hellaswag", None, "validation", hellaswag_doc),
    "piqa": ("baber/piqa", None, "validation", piqa_doc),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test", arc_doc),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test", arc_doc),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", winogrande_doc),
}


def doc_scoring(doc):  # or an InputError: what is wrong with doc
    need(isinstance(doc, dict), f"expected a JSON object, got {type(doc).__name__}")
    found = [k for k, f in FIELDS.items() if f[0] in doc]
    need(len(found) == 1, "expected the fields of one scoring: " + " or ".join(map(str, FIELDS.values())))
    scoring, = found
    missing = [f for f in FIELDS[scoring] if f not in doc]
    need(not missing, f"missing {', '.join(missing)}")
    if scoring == "lambada":
        need(isinstance(doc["text"], str) and " " in doc["text"],
             '"text" must be a string with a space (its last word is the target)')
        return scoring
    o, t = ("choices", "context") if scoring == "choice" else ("contexts", "continuation")
    options, label = doc[o], doc["label"]
    need(isinstance(options, list) and len(options) >= 2 and all(isinstance(x, str) and x for x in options),
         f'"{o}" must be a list of at least two non-empty strings')
    need(isinstance(doc[t], str), f'"{t}" must be a string')
    need(count(label) and label < len(options),
         f'"label" must be an integer index into the {len(options)} options, got {label!r}')
    return scoring


def task_name(path):  # mine.jsonl is the task "mine"
    return os.path.splitext(os.path.basename(path))[0]


def load_task_file(path, limit=0):
    """(task_name(path), scoring, docs) from a JSONL file: a doc per line, one scoring."""
    need(os.path.isfile(path), f"task file {path} not found")
    need(count(limit), f"limit={limit!r}: use an integer >= 0 (0: every document)")
    docs, scoring = [], None
    with open(path, "rb") as f:  # bytes: a non-UTF-8 line is named like any bad line
        for lineno, raw in enumerate(f, 1):
            try:
                if not (line := raw.decode("utf-8")).strip():
                    continue
                k = doc_scoring(doc := json.loads(line))
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                                 "save it as UTF-8") from None
            except ValueError as e:  # json's errors and doc_scoring's
                raise InputError(f"{path}:{lineno}: malformed task line: {e}") from None
            need(scoring in (None, k), f"{path}:{lineno}: a {k} line in a file of {scoring} lines: one scoring per "
                 "file")
            scoring = k
            docs.append(doc)
    need(docs, f"task file {path} has no documents")
    return task_name(path), scoring, docs[:limit or None]


def load_task(name, limit=0):
    """(name, scoring, docs) of a task of TASKS, through `datasets`."""
    path, subset, split, convert = TASKS[name]
    rows = hf_dataset(path, subset, split, alt=f", or pass {name} as --task_file=FILE.jsonl")
    docs = [convert(row) for row in (rows.select(range(min(limit, len(rows)))) if limit else rows)]
    return name, doc_scoring(docs[0]), docs


# Scoring

def encode_pair(tok, context, continuation):
    """lm-eval's token ids of (context, continuation): the context's trailing spaces move over; the continuation is
    what it adds to the context, both encoded with default special tokens. An empty or blank context is tok.eot."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    if not context:
        need(tok.eot is not None, f"an empty context is scored after an end-of-text token: {tok.name} has none")
        cont = tok.encode(continuation)
        return [tok.eot], cont[1:] if cont[:1] == [tok.eot] else cont
    whole, ctx = tok.encode_default(context + continuation), tok.encode_default(context)
    return ctx, whole[len(ctx):]


def batch_logits(lm, inputs, batch_size, desc):
    """(i, logits (len(inputs[i]), vocab)) of each input (token ids), in right-padded batches, longest first."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))  # little padding
    for b in progress(range(0, len(order), batch_size), desc=desc, leave=False):
        batch = order[b:b + batch_size]
        x = pad_sequence([torch.from_numpy(np.asarray(inputs[i], dtype=np.int64)) for i in batch], batch_first=True)
        logits = lm.logits(x.to(lm.device), torch.tensor([len(inputs[i]) for i in batch]))  # (B, T, vocab)
        yield from ((i, logits[r, :len(inputs[i])]) for r, i in enumerate(batch))


@torch.no_grad()
def loglikelihoods(lm, requests, batch_size, desc="score"):
    """The harness's loglikelihood: per (context, continuation), (log-likelihood, all greedy?) of the continuation."""
    inputs, conts = [], []
    for context, continuation in requests:
        ctx, cont = encode_pair(lm.tok, context, continuation)
        need(1 <= len(cont) <= lm.block_size, f"continuation {continuation!r}: {len(cont)} tokens, not in "
             f"1..block_size={lm.block_size}")
        inputs.append((ctx + cont)[-(lm.block_size + 1):-1])  # left-truncated to block_size
        conts.append(cont)
    out = [None] * len(inputs)
    for i, logits in batch_logits(lm, inputs, batch_size, desc):
        logp = logits[-len(conts[i]):].float().log_softmax(-1)  # (len(cont), vocab): predicts cont
        target = torch.tensor(conts[i], device=logp.device)
        out[i] = (logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all()))
    return out


def mean_stderr(xs):
    """The harness's mean and mean_stderr."""
    need(len(xs) > 0, "mean_stderr of no values: the task has no documents")
    return float(np.mean(xs)), (float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None)


def bootstrap_stderr(f, xs, iters):
    """lm-eval's bootstrap_stderr: the std of f over iters // m rounds of m = min(1000, iters) resamples of xs,
    round i by random.Random(i).choices, which numpy replays; f maps (m, n) resamples to (m,)."""
    xs, n, m = np.asarray(xs, dtype=np.float64), len(xs), min(1000, iters)
    if n < 2 or iters < 1:
        return None
    res = []
    for i in range(iters // m):
        state = random.Random(i).getstate()[1]  # 624 words, then a position
        rng = np.random.RandomState()
        rng.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
        res.append(f(xs[np.floor(rng.random_sample((m, n)) * n).astype(np.int64)]))  # choices: xs[floor(rand * n)]
    return float(np.std(np.concatenate(res), ddof=1))


def requests_of(scoring, doc):
    if scoring == "lambada":
        context, _, target = doc["text"].rpartition(" ")
        return [(context, " " + target)]
    if scoring == "choice":
        return [(doc["context"], " " + c) for c in doc["choices"]]
    return [(c, " " + doc["continuation"]) for c in doc["contexts"]]


def evaluate_task(lm, name, scoring, docs, batch_size, bootstrap_iters=100000):
    """{metric: (value, stderr)}. acc: the top log-likelihood's option is the label; acc_norm (multiple choice): the
    same over len(choice). LAMBADA: acc: every target token greedy; ppl = exp(-mean log-likelihood)."""
    reqs = [requests_of(scoring, d) for d in docs]
    flat = loglikelihoods(lm, [r for rs in reqs for r in rs], batch_size, desc=name)
    if scoring == "lambada":
        lls = [ll for ll, _ in flat]
        return {"acc": mean_stderr([float(greedy) for _, greedy in flat]),
                "ppl": (math.exp(-np.mean(lls)), bootstrap_stderr(lambda s: np.exp(-s.mean(-1)), lls, bootstrap_iters))}
    acc, acc_norm, it = [], [], iter(flat)
    for d, rs in zip(docs, reqs):
        lls = np.array([next(it)[0] for _ in rs])
        acc.append(float(np.argmax(lls) == d["label"]))
        if scoring == "choice":
            acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in d["choices"]])) == d["label"]))
    return {"acc": mean_stderr(acc), **({"acc_norm": mean_stderr(acc_norm)} if acc_norm else {})}
