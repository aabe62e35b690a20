"""
Evaluate a language model: perplexity, zero-shot tasks scored the way EleutherAI's
lm-evaluation-harness scores them, and training-free attention swaps, for our
checkpoints, GPT-2 and any Hugging Face causal LM.

  python eval.py --out_dir=out                                   # perplexity on the checkpoint's val.bin
  python eval.py --out_dir=out --tasks=ppl,lambada,hellaswag     # + zero-shot tasks (needs `datasets`)
  python eval.py --out_dir=out --task_file=mine.jsonl            # a task from a local JSONL file
  python eval.py --out_dir=out --attn=sa --window=64 --seeds=5   # a swap; SA as mean ± std over seeds
  python eval.py --init_from=gpt2 --dataset=wikitext-103 --split=test --windows=16,32,64,128,256
  python eval.py --init_from=Qwen/Qwen3-0.6B --tasks=lambada --windows=32,64,128 --json=qwen.json

Models (--init_from):
  resume            out_dir/ckpt.pt from train.py, with its dataset's tokenizer
  gpt2, gpt2-*      GPT-2's weights in our GPT (GPT.from_pretrained; needs transformers)
  anything else     a Hugging Face causal LM id or local path (needs transformers): our swa,
                    sa and moba run inside it through transformers' AttentionInterface,
                    see register_hf_attention()

Perplexity: data_root/<dataset>/<split>.bin in non-overlapping block_size windows;
every token but the first is predicted once, from the start of its window. Bits per
byte = the loss in bits over the UTF-8 bytes of the predicted text, so byte-level
and BPE models compare. A model with another tokenizer than the dataset's (a
Hugging Face model) reads the decoded text re-encoded with its own.

Zero-shot scoring, lm-evaluation-harness's (zero-shot, its prompt formats):
  multiple choice   the log-likelihood of " " + choice after the context, summed over
                    its tokens; acc = its argmax, acc_norm = the argmax of it divided by
                    len(choice) in characters. Partial scoring (WinoGrande): the contexts
                    differ and the continuation is shared; acc only.
  LAMBADA           context = all but the last word, target = " " + the last word; acc
                    counts a document only if every target token is the greedy argmax;
                    ppl = exp(-mean target log-likelihood)
  stderr            sample std / sqrt(n), the harness's mean_stderr
  tokens            the context alone, then what context + continuation adds to it;
                    an input longer than block_size loses tokens on the left
Batches are right-padded: causal attention, every kind here, never shows a pad to a
real token.

Swaps: --attn (a comma list) with --window or --windows; MoBA gets the same key budget,
moba_block = window // moba_topk (unless --moba_block is set). sa+swa needs its trained
gates, so it cannot be swapped in. SA draws fresh permutations every forward pass (which
depend on the padded batch length); --seeds=N reports mean ± std over N seeds. A sweep
prints a kind x window table per task (ppl, or acc) and plots it with matplotlib.
"""
import json as json_lib
import math
import os
import re
import sys
from collections import namedtuple
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

import attention
from model import GPT, load_checkpoint
from prepare_data import get_tokenizer, load_meta, load_tokens, progress

# -----------------------------------------------------------------------------
init_from = "resume"   # resume (out_dir/ckpt.pt), gpt2 / gpt2-medium / gpt2-large / gpt2-xl, or a Hugging Face causal LM
out_dir = "out"        # where resume finds ckpt.pt
data_root = "data"     # prepared datasets live in data_root/<dataset>/
dataset = ""           # dataset for perplexity ("" = the checkpoint's)
split = "val"          # its split for perplexity (wikitext-103 also has test)
tasks = ""             # comma list of ppl, lambada, hellaswag, piqa, arc_easy, arc_challenge, winogrande ("" = ppl, or just the task files)
task_file = ""         # comma list of JSONL task files, each a task named after its file (format in the README)
limit = 0              # at most this many documents per task, and windows for ppl (0 = all)
attn = ""              # comma list of attention kinds to swap in: full, swa, sa, sa+swa, moba ("" = the model's own)
window = None          # the swa/sa window of a swap (None = the model's own)
windows = ""           # comma list of windows to sweep, e.g. 16,32,64,128,256
moba_block = None      # MoBA's block size (None = window // moba_topk: the window's key budget)
moba_topk = 4          # MoBA's blocks per query, its own included
seeds = 1              # evaluate SA with permutation seeds 0..seeds-1: mean ± std
block_size = None      # context length (None = the model's; Hugging Face models: at most 2048)
batch_size = 8         # sequences per forward pass
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
json = ""              # also write the results to this JSON file
plot = "sweep.png"     # where a sweep saves its plot ("" = no plot)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k[:1].islower() and isinstance(v, (int, float, bool, str, type(None)))}
GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256}  # what prepare_data.py writes for GPT-2 BPE
KINDS = ("full", "swa", "sa", "sa+swa", "moba")
HF_MAX_BLOCK = 2048    # a Hugging Face model's default context here: its max_position_embeddings can be 40k

Tokenizer = namedtuple("Tokenizer", "name encode decode eot")  # name: "bytes", "gpt2", "hf:<model>", ...


# -----------------------------------------------------------------------------
# Models: ours (a checkpoint or GPT-2) and Hugging Face's, behind one interface:
# tok, block_size, device, native (its own attention), logits(idx), use(setting), seed(s)

class OurLM:

    def __init__(self, model, tok, block_size, device, ctx):
        self.model, self.tok, self.device, self.ctx = model.eval(), tok, device, ctx
        self.block_size = min(block_size or model.config.block_size, model.config.block_size)
        kind = model.config.attn
        self.native = {"attn": kind, **({"window": model.config.window} if kind in ("swa", "sa", "sa+swa") else {})}

    def logits(self, idx):
        with self.ctx:
            return self.model(idx)[0]                                            # (B, T, vocab)

    def use(self, setting):
        self.model.swap_attention(**setting)

    def seed(self, s):
        self.model.sa_generator.manual_seed(s)


class HFLM:

    def __init__(self, model, tok, block_size, device):
        self.model, self.tok, self.device = model.eval(), tok, device
        self.block_size = block_size or min(getattr(model.config, "max_position_embeddings", HF_MAX_BLOCK), HF_MAX_BLOCK)
        self.native = {"attn": "full"}
        self.native_impl = model.config._attn_implementation  # "full" goes back to it
        self.generator = torch.Generator()                     # SA's permutations

    def logits(self, idx):
        return self.model(input_ids=idx, use_cache=False).logits                # (B, T, vocab)

    def use(self, setting):
        name = self.native_impl if setting["attn"] == "full" else register_hf_attention(**setting, generator=self.generator)
        self.model.set_attn_implementation(name)

    def seed(self, s):
        self.generator.manual_seed(s)


def register_hf_attention(attn, window=None, moba_block=64, moba_topk=4, generator=None):
    """Register one of our attentions in transformers' AttentionInterface; returns its name.

        name = register_hf_attention("sa", window=64, generator=torch.Generator().manual_seed(0))
        model.set_attn_implementation(name)    # or from_pretrained(..., attn_implementation=name)

    Every model whose attention layers dispatch through ALL_ATTENTION_FUNCTIONS (Qwen3,
    Llama, Mistral, ...) then runs it in every layer. It gets q (B, H, T, D) and k, v
    (B, H_kv, T, D) after the model's RoPE, repeats the kv heads for grouped-query
    attention, honours the model's softmax scaling (ours is 1/sqrt(D), so q is rescaled),
    and draws one SA permutation per layer call from `generator` (a CPU torch.Generator).
    Only a pass with as many keys as queries (prefill, scoring) is sparse: one-token
    decoding against a KV cache falls back to full attention over the cache (sdpa), as the
    paper did. transformers builds no padding mask for a custom name, so pad on the right
    only: causality keeps pads out of every real token's view. Inference only: no dropout."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        raise SystemExit("Hugging Face models need transformers: pip install transformers") from None
    if attn not in ("swa", "sa", "moba"):
        raise ValueError(f"a Hugging Face model can run swa, sa or moba, not {attn!r}"
                         + (": sa+swa needs gates trained with the model" if attn == "sa+swa" else ""))
    if attn == "moba":
        attention.check_positive(moba_block, "moba_block"), attention.check_positive(moba_topk, "moba_topk")
    else:
        attention.check_positive(window)
    generator = torch.Generator() if generator is None else generator

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, H, T, D = query.shape
        if key.shape[2] != T:
            if T != 1:
                raise ValueError(f"{attn} attention runs a full pass (T keys for T queries) or decodes one token "
                                 f"against a cache; got {T} queries and {key.shape[2]} keys")
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        rep = H // key.shape[1]
        k = key.repeat_interleave(rep, dim=1)                                    # (B, H, T, D)
        v = value.repeat_interleave(rep, dim=1)                                  # (B, H, T, D)
        q = query if scaling is None else query * (scaling * math.sqrt(D))       # (B, H, T, D)
        if attn == "swa":
            y = attention.sliding_window_attention(q, k, v, window)
        elif attn == "sa":
            y = attention.stochastic_attention(q, k, v, window, torch.randperm(T, generator=generator).to(q.device))
        else:
            y = attention.moba_attention(q, k, v, moba_block, moba_topk)
        return y.transpose(1, 2).contiguous(), None                              # (B, T, H, D)

    name = f"moba_b{moba_block}_k{moba_topk}" if attn == "moba" else f"{attn}_w{window}"
    AttentionInterface.register(name, forward)
    return name


def tokenizer(meta):
    return Tokenizer(meta["tokenizer"], *get_tokenizer(meta), meta.get("eot"))


def load_model(cfg):
    """(lm, dataset of the checkpoint or "") for cfg["init_from"]."""
    dev = cfg["device"]
    device_type = "cuda" if "cuda" in dev else "cpu"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if cfg["dtype"] not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {cfg['dtype']!r}")
    ptdtype = dtypes[cfg["dtype"]]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    if cfg["init_from"] == "resume":
        model, ckpt = load_checkpoint(os.path.join(cfg["out_dir"], "ckpt.pt"), dev)
        meta = ckpt["meta"]  # its dataset's meta.json: the tokenizer
        return OurLM(model, tokenizer(meta), cfg["block_size"], dev, ctx), ckpt["config"]["dataset"]
    if cfg["init_from"] in GPT2_SIZES:
        return OurLM(GPT.from_pretrained(cfg["init_from"]).to(dev), tokenizer(GPT2_META), cfg["block_size"], dev, ctx), ""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise SystemExit(f"--init_from={cfg['init_from']} loads a Hugging Face model: pip install transformers") from None
    hf_tok = AutoTokenizer.from_pretrained(cfg["init_from"])
    model = AutoModelForCausalLM.from_pretrained(cfg["init_from"], dtype=ptdtype).to(dev)
    eot = hf_tok.bos_token_id if hf_tok.bos_token_id is not None else hf_tok.eos_token_id
    tok = Tokenizer(f"hf:{cfg['init_from']}", lambda s: hf_tok(s, add_special_tokens=False)["input_ids"],
                    hf_tok.decode, eot)
    return HFLM(model, tok, cfg["block_size"], dev), ""


# -----------------------------------------------------------------------------
# Tasks: each is (name, kind, docs) with kind one of
#   "choice"   {"context": str, "choices": [str, ...], "label": int}
#   "partial"  {"contexts": [str, ...], "continuation": str, "label": int}   (WinoGrande)
#   "lambada"  {"text": str}

FIELDS = {"choice": ("context", "choices", "label"), "partial": ("contexts", "continuation", "label"), "lambada": ("text",)}


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
             lambda d: {"context": f"Question: {d['goal']}\nAnswer:", "choices": [d["sol1"], d["sol2"]], "label": int(d["label"])}),
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
        raise ValueError(f'"{"choices" if kind == "choice" else "contexts"}" must be a list of at least two non-empty strings')
    if not isinstance(text, str):
        raise ValueError(f'"{"context" if kind == "choice" else "continuation"}" must be a string')
    label = doc["label"]
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
        raise ValueError(f'"label" must be an integer index into the {len(options)} options, got {label!r}')
    return kind


def load_task_file(path, limit=0):
    """(name, kind, docs) from a JSONL file: one doc per line, all of one kind."""
    if not os.path.isfile(path):
        raise ValueError(f"task file {path} not found")
    docs, kind = [], None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json_lib.loads(line)
                k = doc_kind(doc)
            except ValueError as e:  # json's errors are ValueErrors too
                raise ValueError(f"{path}:{lineno}: malformed task line: {e}") from None
            if kind not in (None, k):
                raise ValueError(f"{path}:{lineno}: a {k} line in a file of {kind} lines: one kind per file")
            kind = k
            docs.append(doc)
    if not docs:
        raise ValueError(f"task file {path} has no documents")
    return os.path.splitext(os.path.basename(path))[0], kind, docs[:limit or None]


def load_task(name, limit=0):
    """(name, kind, docs) of a known task, through the `datasets` package."""
    path, config, split, convert = TASKS[name]
    try:
        import datasets
    except ImportError:
        raise SystemExit(f"task {name} is downloaded with the `datasets` package: pip install datasets, "
                         "or pass the task as --task_file=FILE.jsonl") from None
    try:
        rows = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline shows up as several exception types
        raise SystemExit(f"could not load {path} for task {name} ({type(e).__name__}: {str(e)[:200]}); "
                         "offline? pass it as --task_file=FILE.jsonl") from None
    docs = [convert(row) for row in (rows.select(range(min(limit, len(rows)))) if limit else rows)]
    return name, doc_kind(docs[0]), docs


# -----------------------------------------------------------------------------
# Scoring

def encode_pair(tok, context, continuation):
    """Token ids of (context, continuation), split as the harness splits them: the context's
    trailing spaces move to the continuation, and the continuation's tokens are what it adds
    to the context's; an empty context is the end-of-text token."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        if tok.eot is None:
            raise ValueError(f"an empty context is scored after the end-of-text token, which the {tok.name} tokenizer lacks")
        return [tok.eot], tok.encode(continuation)
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def loglikelihoods(lm, requests, batch_size, desc="score"):
    """[(log-likelihood of the continuation, every continuation token the greedy argmax)] per
    (context, continuation) request, the harness's loglikelihood."""
    items = []
    for context, continuation in requests:
        ctx, cont = encode_pair(lm.tok, context, continuation)
        if not 1 <= len(cont) <= lm.block_size:
            raise ValueError(f"continuation {continuation!r} is {len(cont)} tokens: it must fit in 1..block_size={lm.block_size}")
        items.append(((ctx + cont)[-(lm.block_size + 1):-1], cont))  # the input, left-truncated to block_size
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # longest first: little padding
    out = [None] * len(items)
    for b in progress(range(0, len(order), batch_size), desc=desc, total=math.ceil(len(order) / batch_size), leave=False):
        batch = order[b:b + batch_size]
        x = torch.zeros(len(batch), len(items[batch[0]][0]), dtype=torch.long)  # (B, T), right-padded
        for r, i in enumerate(batch):
            x[r, :len(items[i][0])] = torch.tensor(items[i][0])
        logits = lm.logits(x.to(lm.device))                                      # (B, T, vocab)
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
    return float(np.mean(xs)), (float(np.std(xs, ddof=1) / math.sqrt(n)) if n > 1 else None)


def requests_of(kind, doc):
    if kind == "lambada":
        words = doc["text"].split(" ")
        return [(" ".join(words[:-1]), " " + words[-1])]
    if kind == "choice":
        return [(doc["context"], " " + c) for c in doc["choices"]]
    return [(c, " " + doc["continuation"]) for c in doc["contexts"]]


def evaluate_task(lm, name, kind, docs, batch_size):
    """{metric: (value, stderr)} of one task."""
    reqs = [requests_of(kind, d) for d in docs]
    flat = loglikelihoods(lm, [r for rs in reqs for r in rs], batch_size, desc=name)
    if kind == "lambada":
        return {"acc": mean_stderr([float(greedy) for _, greedy in flat]),
                "ppl": (math.exp(-np.mean([ll for ll, _ in flat])), None)}
    acc, acc_norm, start = [], [], 0
    for d, rs in zip(docs, reqs):
        lls = np.array([ll for ll, _ in flat[start:start + len(rs)]])
        start += len(rs)
        acc.append(float(np.argmax(lls) == d["label"]))
        if kind == "choice":
            acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in d["choices"]])) == d["label"]))
    return {"acc": mean_stderr(acc), **({"acc_norm": mean_stderr(acc_norm)} if acc_norm else {})}


@torch.no_grad()
def perplexity(lm, tokens, batch_size, limit=0):
    """{loss, ppl, bpb} over `tokens` in non-overlapping block_size windows: window i reads
    tokens[i*bs : (i+1)*bs] and predicts tokens[i*bs+1 : (i+1)*bs+1], so every token but the
    first is predicted exactly once. bpb is None for tokenizers with no text (ids)."""
    bs = lm.block_size
    starts = list(range(0, len(tokens) - 1, bs))[:limit or None]
    if not starts:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(tokens)}")
    nll, n = 0.0, 0
    for b in progress(range(0, len(starts), batch_size), desc="ppl", total=math.ceil(len(starts) / batch_size), leave=False):
        rows = [torch.from_numpy(np.asarray(tokens[s:s + bs + 1], dtype=np.int64)) for s in starts[b:b + batch_size]]
        x = torch.zeros(len(rows), bs, dtype=torch.long)                         # (B, bs)
        y = torch.full((len(rows), bs), -1, dtype=torch.long)                    # (B, bs), -1: padding, not scored
        for r, w in enumerate(rows):
            x[r, :len(w) - 1], y[r, :len(w) - 1] = w[:-1], w[1:]
        T = int((y != -1).sum(1).max())                                          # the last window may be short
        logits = lm.logits(x[:, :T].to(lm.device))                               # (B, T, vocab)
        y = y[:, :T].to(logits.device)
        for r in range(len(rows)):  # one row at a time: fp32 logits of a whole batch can be large
            nll += F.cross_entropy(logits[r].float(), y[r], ignore_index=-1, reduction="sum").item()
        n += int((y != -1).sum())
    end = min(starts[-1] + bs + 1, len(tokens))
    loss = nll / n
    out = {"loss": loss, "ppl": math.exp(loss), "bpb": None}
    if lm.tok.name != "ids":
        scored = [int(t) for t in tokens[1:end]]
        n_bytes = len(scored) if lm.tok.name == "bytes" else len(lm.tok.decode(scored).encode("utf-8"))
        out["bpb"] = nll / math.log(2) / n_bytes
    return out


def perplexity_tokens(cfg, lm, ckpt_dataset):
    """(dataset/split, the tokens perplexity reads in lm's tokenizer)."""
    name = cfg["dataset"] or ckpt_dataset
    if not name:
        raise ValueError("perplexity needs --dataset=NAME, a dataset made by prepare_data.py (e.g. wikitext-103)")
    data_dir = os.path.join(cfg["data_root"], name)
    meta = load_meta(data_dir)
    tokens = load_tokens(data_dir, cfg["split"], meta)
    label = f"{name}/{cfg['split']}"
    if meta["tokenizer"] == lm.tok.name:
        return label, tokens
    if meta["tokenizer"] == "ids":
        raise ValueError(f"dataset {name} holds bare token ids (no text): only a model trained on it can read it")
    return label, np.array(lm.tok.encode(get_tokenizer(meta)[1](tokens.tolist())), dtype=np.int64)


# -----------------------------------------------------------------------------
# Settings, running, reporting

def check_config(cfg):
    """(kinds, windows) asked for, after checking every knob: before a model loads."""
    kinds = [k for k in cfg["attn"].split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown attention kind {k!r}: choose from {', '.join(KINDS)}")
    try:
        ws = [int(w) for w in cfg["windows"].split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"windows must be a comma list of integers, got {cfg['windows']!r}") from None
    if ws and cfg["window"] is not None:
        raise ValueError("give --window or --windows, not both")
    ws = [attention.check_positive(w) for w in (ws or ([cfg["window"]] if cfg["window"] is not None else []))]
    for key in ("moba_topk", "seeds", "batch_size", "moba_block", "block_size"):
        if cfg[key] is not None:
            attention.check_positive(cfg[key], key)
    if not isinstance(cfg["limit"], int) or cfg["limit"] < 0:
        raise ValueError(f"limit must be an integer >= 0, got {cfg['limit']!r}")
    return kinds, ws


def plan(lm, kinds, ws, cfg):
    """The attention settings to evaluate: [None] = the model as it is, else lm.use() kwargs."""
    if not kinds and not ws:
        return [None]
    native = lm.native["attn"]
    kinds = kinds or (["full", "swa", "sa", "moba"] if len(ws) > 1 and native != "sa+swa" else [native])
    if kinds != ["full"] and not ws:
        if "window" not in lm.native:
            raise ValueError(f"--attn={cfg['attn']} on this model needs --window or --windows")
        ws = [lm.native["window"]]
    settings = [{"attn": "full"}] if "full" in kinds else []
    for k in kinds:
        for w in ws if k != "full" else []:
            settings.append({"attn": k, "window": w} if k != "moba" else
                            {"attn": k, "window": w, "moba_block": cfg["moba_block"] or max(1, w // cfg["moba_topk"]),
                             "moba_topk": cfg["moba_topk"]})
    return settings


def run(cfg):
    """Evaluate as cfg (DEFAULTS with overrides) says, print the tables, return the results."""
    cfg = {**DEFAULTS, **cfg}
    names = [t for t in cfg["tasks"].split(",") if t] or ([] if cfg["task_file"] else ["ppl"])
    for t in names:
        if t != "ppl" and t not in TASKS:
            raise ValueError(f"unknown task {t!r}: choose from ppl, {', '.join(TASKS)}, or pass --task_file=FILE.jsonl")
    kinds, ws = check_config(cfg)
    task_list = ([load_task_file(f, cfg["limit"]) for f in cfg["task_file"].split(",") if f]
                 + [load_task(t, cfg["limit"]) for t in names if t != "ppl"])
    lm, ckpt_dataset = load_model(cfg)
    settings = plan(lm, kinds, ws, cfg)
    ppl_name, tokens = perplexity_tokens(cfg, lm, ckpt_dataset) if "ppl" in names else (None, None)
    rows = []
    for setting in settings:
        if setting is not None:
            lm.use(setting)
        label = setting or lm.native
        for seed in range(cfg["seeds"] if label["attn"] in ("sa", "sa+swa") else 1):
            lm.seed(seed)
            found = {}
            if tokens is not None:
                p = perplexity(lm, tokens, cfg["batch_size"], cfg["limit"])
                found[ppl_name] = {k: (v, None) for k, v in p.items() if v is not None}
            for name, kind, docs in task_list:
                found[name] = evaluate_task(lm, name, kind, docs, cfg["batch_size"])
            for task, metrics in found.items():
                for metric, (value, stderr) in metrics.items():
                    rows.append({"attn": label["attn"], "window": label.get("window"), "seed": seed,
                                 "task": task, "metric": metric, "value": value, "stderr": stderr})
    results = aggregate(rows)
    print(table(results))
    if len({r["window"] for r in results if r["attn"] != "full"}) > 1:
        print(sweep_tables(results))
        if cfg["plot"]:
            plot_sweep(results, cfg["plot"])
    if cfg["json"]:
        os.makedirs(os.path.dirname(cfg["json"]) or ".", exist_ok=True)
        with open(cfg["json"], "w") as f:
            json_lib.dump({"config": cfg, "results": results, "per_seed": rows}, f, indent=1)
    return results


def aggregate(rows):
    """One result per (attn, window, task, metric): the mean over seeds, its std across
    seeds (None for one seed) and the mean of the per-seed stderrs."""
    groups = {}
    for r in rows:
        groups.setdefault((r["attn"], r["window"], r["task"], r["metric"]), []).append(r)
    out = []
    for (a, w, t, m), rs in groups.items():
        values = [r["value"] for r in rs]
        stderrs = [r["stderr"] for r in rs if r["stderr"] is not None]
        out.append({"attn": a, "window": w, "task": t, "metric": m, "value": float(np.mean(values)),
                    "stderr": float(np.mean(stderrs)) if stderrs else None,
                    "seed_std": float(np.std(values, ddof=1)) if len(values) > 1 else None, "seeds": len(values)})
    return out


def fmt(x):
    return "-" if x is None else f"{x:.4f}"


def table(results):
    head = ("attn", "window", "task", "metric", "value", "stderr", "seed std")
    body = [(r["attn"], "-" if r["window"] is None else str(r["window"]), r["task"], r["metric"],
             fmt(r["value"]), fmt(r["stderr"]), fmt(r["seed_std"])) for r in results]
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in [head] + body)


def headline(results, task):
    """The metric a sweep shows for a task: acc, or ppl for perplexity."""
    return "acc" if any(r["task"] == task and r["metric"] == "acc" for r in results) else "ppl"


def sweep_tables(results):
    """Per task, kind x window -> its headline metric (mean ± std over seeds)."""
    ws = sorted({r["window"] for r in results if r["window"] is not None and r["attn"] != "full"})
    out = []
    for task in dict.fromkeys(r["task"] for r in results):
        metric = headline(results, task)
        cells = {(r["attn"], r["window"]): r for r in results if r["task"] == task and r["metric"] == metric}
        lines = [f"\n{task} {metric}", "attn".ljust(8) + "".join(f"{w:>18}" for w in ws)]
        for kind in dict.fromkeys(a for a, _ in cells):
            def cell(w):
                r = cells.get((kind, None if kind == "full" else w))
                return "-" if r is None else fmt(r["value"]) + (f" ± {r['seed_std']:.4f}" if r["seed_std"] is not None else "")
            lines.append(kind.ljust(8) + "".join(f"{cell(w):>18}" for w in ws))
        out.append("\n".join(lines))
    return "\n".join(out)


def plot_sweep(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(pip install matplotlib for the sweep's plot)")
        return
    tasks = list(dict.fromkeys(r["task"] for r in results))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = headline(results, task)
        rs = [r for r in results if r["task"] == task and r["metric"] == metric]
        for kind in dict.fromkeys(r["attn"] for r in rs):
            pts = sorted((r["window"], r["value"], r["seed_std"] or 0.0) for r in rs if r["attn"] == kind)
            if kind == "full":
                ax.axhline(pts[0][1], color="gray", ls="--", lw=1, label="full")
            else:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("window")
        ax.set_title(f"{task} {metric}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved {path}")


if __name__ == "__main__":
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    try:
        run(config)
    except ValueError as e:
        sys.exit(f"eval.py: {e}")
