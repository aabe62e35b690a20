"""
Support, which a first reading skips. Evaluate a language model: perplexity, zero-shot tasks scored as EleutherAI's lm-evaluation-harness 0.4.13
scores them (the tasks section below), and training-free attention swaps, for our checkpoints, GPT-2 and Hugging Face LMs.

  python eval.py --out_dir=out-quick                                   # perplexity on the checkpoint's val.bin
  python eval.py --out_dir=out-quick --tasks=ppl,lambada,hellaswag     # + zero-shot tasks (needs `datasets`)
  python eval.py --out_dir=out-quick --task_file=mine.jsonl            # a task from a local JSONL file
  python eval.py --out_dir=out-full --attn=sa --window=64 --seeds=5    # a swap; SA as mean ± std over seeds
  python eval.py --init_from=gpt2 --dataset=wikitext-103 --split=test --windows=16,32,64,128,256
  python eval.py --init_from=Qwen/Qwen3-0.6B --tasks=lambada --windows=32,64,128 --json_out=res/qwen.json

A swap evaluates the same weights with another attention. It needs no training, because swa, sa and moba have
no weights of their own; a Hugging Face model's attention is replaced through register_hf_attention. Batches
are right-padded, and SA permutes only each row's real tokens, so that a document's score never depends on
what else is in its batch.
"""
import json
import math
import os
import random
import re
from collections import namedtuple

import numpy as np
import torch
import torch.nn.functional as F

import attention
from checkpoint import load_checkpoint
from guards import InputError, check_count, need, path_problem, setting_problem
from model import DTYPES, GPT, GPT2_SIZES, KINDS, autocast, hub_offline, swapped
from prepare_data import dataset_dir, get_tokenizer, load_meta, load_tokens, progress, pyplot

# -----------------------------------------------------------------------------
init_from = "resume"   # resume (out_dir/ckpt.pt), gpt2 / gpt2-medium / gpt2-large / gpt2-xl, or a Hugging Face LM
out_dir = "out"        # where resume finds ckpt.pt (and a sweep saves its plot without --json_out)
data_root = "data"     # prepared datasets live in data_root/<dataset>/
dataset = ""           # dataset for perplexity ("" = the checkpoint's)
split = "val"          # its split for perplexity (wikitext-103 also has test)
tasks = ""             # comma list of ppl, lambada, hellaswag, piqa, arc_easy, arc_challenge, winogrande ("" = ppl)
task_file = ""         # comma list (no commas in paths) of JSONL task files, each a task named after its file; no ppl
limit = 0              # at most this many documents per task, and block_size segments for ppl (0 = all)
attn = ""              # comma list of attention kinds to swap in: full, swa, sa, sa+swa, moba ("" = the model's own)
window: int | None = None  # the swa/sa window of a swap (None = the model's own)
windows = ""           # comma list of windows to sweep, e.g. 16,32,64,128,256
moba_chunk: int | None = None  # MoBA's key chunk (None = window // moba_topk: the window's key budget)
moba_topk = 4          # MoBA's chunks per query, its own included
seeds = 1              # evaluate SA with permutation seeds 0..seeds-1: mean ± std
block_size: int | None = None  # context length cap (None = the model's block_size)
batch_size = 8         # sequences per forward pass
bootstrap_iters = 100000  # resamples for the LAMBADA ppl stderr, lm-eval's default (0 = none)
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
json_out = ""          # also write the results to this JSON file
plot = "sweep.png"     # a sweep's plot; a bare file name goes next to --json_out, else into out_dir ("" = no plot)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k[:1].islower() and isinstance(v, (int, float, str, type(None)))}
GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256}  # what prepare_data.py writes for GPT-2 BPE


def run(settings):
    """Evaluate as settings (DEFAULTS with overrides) say, print the tables, return the results."""
    settings = {**DEFAULTS, **settings}
    ppl, names, files, kinds, ws, plot_path = check_settings(settings)
    limit = settings["limit"]
    task_list = [load_task_file(f, limit) for f in files] + [load_task(t, limit) for t in names]
    lm, ckpt_dataset = load_model(settings)
    swaps = plan(lm, kinds, ws, settings)
    c = lm.model.config  # ours or Hugging Face's: what runs the attention of the kinds about to run
    print(attention.impl_line(settings["device"], DTYPES[settings["dtype"]], c.n_embd // c.n_head if hasattr(
        c, "n_embd") else c.hidden_size // c.num_attention_heads, [s["attn"] for s in swaps if s] or
        [lm.native["attn"]], getattr(c, "sa_rule", "rank")))
    ppl_name, tokens = perplexity_tokens(settings, lm, ckpt_dataset) if ppl else (None, None)
    rows = []
    for swap in swaps:
        if swap is not None:
            lm.use(swap)
        label = swap or lm.native
        for seed in range(settings["seeds"] if KINDS[label["attn"]].draws else 1):
            lm.seed(seed)
            found = {}
            if tokens is not None:
                p = perplexity(lm, tokens, settings["batch_size"], limit)
                found[ppl_name] = {k: (v, None) for k, v in p.items() if v is not None}
            for name, scoring, docs in task_list:
                found[name] = evaluate_task(lm, name, scoring, docs, settings["batch_size"],
                                            settings["bootstrap_iters"])
            for task, metrics in found.items():
                for metric, (value, stderr) in metrics.items():
                    rows.append({"attn": label["attn"], "window": label.get("window"), "seed": seed,
                                 "task": task, "metric": metric, "value": value, "stderr": stderr})
    results = aggregate(rows)
    print(table(results))
    try:
        if len({r["window"] for r in results if r["attn"] != "full"}) > 1:
            print(sweep_tables(results))
            if plot_path:
                plot_sweep(results, plot_path)
        if settings["json_out"]:
            os.makedirs(os.path.dirname(settings["json_out"]) or ".", exist_ok=True)
            with open(settings["json_out"], "w") as f:
                json.dump({"settings": settings, "results": results, "per_seed": rows}, f, indent=1)
    except OSError as e:  # a full disk
        raise InputError(f"cannot write {e.filename or settings['json_out']}: {e.strerror or e} "
                         "(the tables above are complete)") from None
    return results


def check_settings(s):
    """(ppl?, tasks, task files, kinds, windows, plot path) that settings s ask for, after checking each, up front
    (guards.SETTINGS: configurator.py does it for the command line, tests call run() with a dict)."""
    for key, value in s.items():
        problem = setting_problem(key, value, s)
        need(problem is None and (type(value) is type(DEFAULTS[key]) or key in ("window", "moba_chunk", "block_size")
                                  and type(value) in (int, type(None))), f"{key}={value!r}: {problem or 'its type'}")
    repeat = lambda xs: next((x for i, x in enumerate(xs) if x in xs[:i]), None)  # noqa: E731

    def items(key, parse=str, known=None):  # a repeat would be averaged in with the first, as another seed
        try:
            got = [parse(x.strip()) for x in s[key].split(",") if x.strip()]
        except ValueError:
            raise InputError(f"{key} must be a comma list of integers, got {s[key]!r}") from None
        need(repeat(got) is None, f"{key}={s[key]!r}: lists {repeat(got)!r} twice: give each once (a repeat would be "
             "averaged in as another seed)")
        unknown = next((x for x in got if known and x not in known), None)
        need(unknown is None, f"{key}={s[key]!r}: unknown {unknown!r}: choose from {', '.join(known or ())}")
        return got
    names, files = items("tasks", known=("ppl", *TASKS)), items("task_file")
    kinds, ws = items("attn", known=tuple(KINDS)), items("windows", int)
    tasks = [t for t in names if t != "ppl"]
    clash = repeat(tasks + [task_name(f) for f in files])  # results are keyed by a task's name (ppl's by its data)
    need(clash is None, f"task_file={s['task_file']!r}: two tasks are named {clash!r} (a task is named after its "
         "file): rename one")
    need(not (ws and s["window"] is not None), "give --window or --windows, not both")
    ws = ws or ([s["window"]] if s["window"] is not None else [])
    need(all(w >= 1 for w in ws), f"windows={s['windows']!r}: use integers >= 1")
    if s["dataset"]:
        dataset_dir(s["data_root"], s["dataset"])
    plot_path = os.path.join("" if os.path.dirname(s["plot"]) else os.path.dirname(s["json_out"]) or s["out_dir"],
                             s["plot"]) if s["plot"] else ""
    if plot_path and len(ws) > 1:  # before the long part
        need(path_problem(plot_path, is_file=True) is None, f"plot={s['plot']!r}: "
             f"{path_problem(plot_path, is_file=True)}")
    return "ppl" in names or not (names or files), tasks, files, kinds, ws, plot_path


def plan(lm, kinds, ws, settings):
    """The attention swaps to evaluate: [None] = the model as it is, else lm.use() kwargs. A sweep without --attn
    covers every kind that is one function (model.KINDS); an sa+swa model keeps its kind (model.swapped says why),
    so that its sweep varies the window of both its paths."""
    if not kinds and not ws:
        return [None]
    native = lm.native["attn"]
    kinds = kinds or ([k for k, kind in KINDS.items() if kind.fn] if len(ws) > 1 and native != "sa+swa" else [native])
    if kinds != ["full"] and not ws:
        need("window" in lm.native, f"--attn={settings['attn']} on this model needs --window or --windows")
        ws = [lm.native["window"]]
    swaps = [{"attn": "full"}] if "full" in kinds else []
    for k in kinds:
        for w in ws if k != "full" else []:
            swaps.append({"attn": k, "window": w} if k != "moba" else
                         {"attn": k, "window": w, "moba_chunk": settings["moba_chunk"] or max(
                             1, w // settings["moba_topk"]), "moba_topk": settings["moba_topk"]})
    for swap in swaps if isinstance(lm, OurLM) else []:  # every swap checked before the first one runs
        swapped(lm.model.config, **swap)
    return swaps


# -----------------------------------------------------------------------------
# Models: ours (a checkpoint or GPT-2) and Hugging Face's, behind one interface:
# tok, block_size, device, native (its own attention), logits(idx, lengths), use(setting), seed(s)

class OurLM:

    def __init__(self, model, tok, block_size, device, ctx):
        self.model, self.tok, self.device, self.ctx = model.eval(), tok, device, ctx
        self.block_size = min(block_size or model.config.block_size, model.config.block_size)
        kind = model.config.attn
        self.native = {"attn": kind, **({"window": model.config.window} if "window" in KINDS[kind].args or
                                        KINDS[kind].draws else {})}

    def logits(self, idx, lengths=None):
        """lengths (B,): each row's real tokens; SA then permutes only those (GPT.draw_sa)."""
        with self.ctx:
            return self.model(idx, lengths=lengths)[0]                           # (B, T, vocab)

    def use(self, setting):
        self.model.swap_attention(**setting)

    def seed(self, s):
        self.model.seed_sa(s)


def hf_context_length(config, tokenizer_max=None):
    """lm-eval's resolve_max_length: n_positions, max_position_embeddings or n_ctx of the (text)
    config, else the tokenizer's model_max_length unless unset (~1e30), else 2048."""
    text = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(text, attr, None) is not None:
            return int(getattr(text, attr))
    return int(tokenizer_max) if tokenizer_max is not None and tokenizer_max < 1e29 else 2048


class HFLM:

    def __init__(self, model, tok, block_size, device, tokenizer_max=None):
        self.model, self.tok, self.device = model.eval(), tok, device
        own = hf_context_length(model.config, tokenizer_max)
        self.block_size = min(block_size or own, own)
        self.native = {"attn": "full"}
        self.native_impl = model.config._attn_implementation  # "full" goes back to it
        self.generator = torch.Generator()                     # SA's permutations

    def logits(self, idx, lengths=None):
        """lengths (B,): each row's real tokens, the rest right padding; the mask keeps SA's
        permutations to the real tokens (causality alone keeps pads away from them)."""
        T = idx.shape[1]
        padded = lengths is not None and not bool((lengths == T).all())
        mask = (torch.arange(T) < lengths[:, None]).to(idx.device) if padded else None
        return self.model(input_ids=idx, attention_mask=mask, use_cache=False).logits  # (B, T, vocab)

    def use(self, setting):
        self.model.set_attn_implementation(self.native_impl if setting["attn"] == "full" else
                                           register_hf_attention(**setting, generator=self.generator))

    def seed(self, s):
        self.generator.manual_seed(s)


HF_IGNORED = ("position_ids", "use_cache", "sliding_window")  # may be dropped: a swap replaces the model's own window


def register_hf_attention(attn, window=None, moba_chunk=64, moba_topk=4, generator=None):
    """Register one of our attentions in transformers' AttentionInterface; returns its name.

        name = register_hf_attention("sa", window=64, generator=torch.Generator().manual_seed(0))
        model.set_attn_implementation(name)    # or from_pretrained(..., attn_implementation=name)

    Every model whose attention layers dispatch through ALL_ATTENTION_FUNCTIONS (Qwen3, Llama, Mistral, ...)
    then runs it in every layer, on q (B, H, T, D) and k, v (B, H_kv, T, D) after the model's RoPE, with kv
    heads repeated for grouped-query attention and the model's softmax scaling. A mask function registered under
    the same name hands over the 2D padding mask, so that each row's real tokens attend as if the row were alone,
    with left or right padding. SA draws one seed per layer call from `generator` (a CPU torch.Generator) and
    permutes each row's real tokens from it (attention.row_perms). Decoding one token against a KV cache, swa
    attends to the last `window` cached keys; sa and moba fall back to full attention over the cache, as the
    paper did (printed once). Inference only: any other attention kwarg (softcap, dropout > 0, ...) raises."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise InputError("Hugging Face models need transformers: pip install transformers") from None
    if attn not in ("swa", "sa", "moba"):
        raise InputError(f"a Hugging Face model can run swa, sa or moba, not {attn!r}"
                         + (": sa+swa needs gates trained with the model" if attn == "sa+swa" else ""))
    sizes = dict(moba_chunk=moba_chunk, moba_topk=moba_topk) if attn == "moba" else dict(window=window)
    for key, value in sizes.items():
        check_count(value, key)
    generator = torch.Generator() if generator is None else generator
    name = f"moba_c{moba_chunk}_k{moba_topk}" if attn == "moba" else f"{attn}_w{window}"
    told = []  # the decoding fallback is printed once

    def padding_mask(attention_mask=None, kv_length=0, kv_offset=0, **_):
        """(B, kv_length) bool, True at real tokens, or None when there is no padding."""
        if attention_mask is None:
            return None
        m = F.pad(attention_mask.bool(), (0, max(0, kv_offset + kv_length - attention_mask.shape[-1])))
        m = m[:, kv_offset:kv_offset + kv_length]  # the keys this layer holds (a sliding cache drops some)
        return None if bool(m.all()) else m

    def draw_perm(lengths, T):
        """(T,) without padding, else (B, 1, T): row b's lengths[b] real tokens permuted, pads after."""
        seed = int(torch.randint(2 ** 62, (), generator=generator))
        return attention.row_perms(seed, torch.tensor([T]), T)[0, 0] if lengths is None else \
            attention.row_perms(seed, lengths, T)

    def sparse(q, k, v, lengths):
        if attn == "swa":
            return attention.sliding_window_attention(q, k, v, window)
        if attn == "moba":
            return attention.moba_attention(q, k, v, moba_chunk, moba_topk)
        return attention.stochastic_attention(q, k, v, window, draw_perm(lengths, q.shape[2]).to(q.device))

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=True, **kwargs):
        unsupported = [f"{k}={v!r}" for k, v in kwargs.items() if k not in HF_IGNORED and v not in (None, False)]
        unsupported += [f"dropout={dropout}"] * bool(dropout) + ["is_causal=False"] * (is_causal is False)
        if unsupported:
            raise InputError(f"the {name} attention does not implement {', '.join(unsupported)}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise InputError(f"the {name} attention takes transformers' padding mask, "
                             f"not a {attention_mask.dim()}D mask")
        (B, H, T, D), S = query.shape, key.shape[2]
        k = key.repeat_interleave(H // key.shape[1], dim=1)                      # (B, H, S, D)
        v = value.repeat_interleave(H // key.shape[1], dim=1)                    # (B, H, S, D)
        q = query if scaling is None else query * (scaling * math.sqrt(D))       # (B, H, T, D)
        if S != T:  # decoding against a KV cache
            if T != 1:
                raise InputError(f"{name} attention runs a full pass (T keys for T queries) or decodes one token "
                                 f"against a cache; got {T} queries and {S} keys")
            keep = torch.ones(B, S, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask
            if attn == "swa":
                own = kwargs.get("sliding_window")
                if own is not None and own < window:
                    raise InputError(f"this model's cache keeps its sliding_window={own} keys: "
                                     f"{name} cannot decode with it")
                keep = keep & (torch.arange(S, device=q.device) >= S - window)   # (B, S): the last `window` slots
            elif not told:
                print(f"{name}: decoding against a KV cache runs full attention over the cache")
                told.append(True)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])  # (B, H, 1, D)
        elif attention_mask is None:
            y = sparse(q, k, v, None)
        else:  # each row's real tokens first, in order, its pads after them: a row attends as if alone
            order = torch.argsort((~attention_mask).to(torch.int8), dim=1, stable=True)  # (B, T)
            idx = order[:, None, :, None].expand(B, H, T, D)                             # (B, H, T, D)
            y = sparse(q.gather(2, idx), k.gather(2, idx), v.gather(2, idx), attention_mask.sum(1))
            y = torch.empty_like(y).scatter_(2, idx, y)                                  # (B, H, T, D) in token order
        return y.transpose(1, 2).contiguous(), None                              # (B, T, H, D)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def load_model(settings):
    """(lm, dataset of the checkpoint or "") for settings["init_from"]."""
    dev, name, ctx = settings["device"], settings["init_from"], autocast(settings["device"], settings["dtype"])
    def ours(model, meta, source):  # our GPT, with meta's tokenizer (meta from source)
        encode, decode = get_tokenizer(meta, source)
        return OurLM(model, Tokenizer(meta["tokenizer"], encode, decode, meta.get("eot"), encode), settings["block_size"],
                     dev, ctx)
    if name == "resume":
        model, ckpt = load_checkpoint(path := os.path.join(settings["out_dir"], "ckpt.pt"), dev, require=("meta", "settings"))
        return ours(model, ckpt["meta"], path), ckpt["settings"].get("dataset", "")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise InputError(f"--init_from={name}: the directory holds no model (a Hugging Face one has a config.json; "
                         f"a train.py out_dir loads with --init_from=resume --out_dir={name})")
    offline = hub_offline(name)
    try:
        if name in GPT2_SIZES:
            return ours(GPT.from_pretrained(name).to(dev), GPT2_META, name), ""
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise InputError(f"--init_from={name} loads a Hugging Face model: pip install transformers") from None
        hf_tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[settings["dtype"]]).to(dev)
    except OSError as e:  # not on the hub, not in the cache, or offline
        why = ("the Hugging Face hub is unreachable and it is not in the local cache" if offline
               else str(e).splitlines()[0][:200])
        raise InputError(f"--init_from={name}: cannot load it ({why}); go online once, or give a local path") from None
    prefix = hf_tok.bos_token_id if hf_tok.bos_token_id is not None else hf_tok.eos_token_id  # lm-eval's prefix token
    prefix_text = hf_tok.decode(prefix) if prefix is not None else None
    tok = Tokenizer(f"hf:{name}", lambda s: hf_tok.encode(s, add_special_tokens=False), hf_tok.decode, prefix,
                    # lm-eval's tok_encode: the tokenizer's defaults, unless the text starts with the prefix token
                    lambda s: hf_tok.encode(s, add_special_tokens=not (prefix_text and s.startswith(prefix_text))))
    return HFLM(model, tok, settings["block_size"], dev, hf_tok.model_max_length), ""


# -----------------------------------------------------------------------------
# Zero-shot tasks: loading them and scoring them the way EleutherAI's lm-evaluation-harness 0.4.13 does (each
# scoring function says which part of lm-eval it follows). A task is (name, scoring, docs), scoring one of
#   "choice"   {"context": str, "choices": [str, ...], "label": int}
#   "partial"  {"contexts": [str, ...], "continuation": str, "label": int}   (WinoGrande)
#   "lambada"  {"text": str}
# A model is anything with tok (a Tokenizer), block_size, device and logits(idx, lengths).

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


def doc_scoring(doc):
    """How one doc is scored (FIELDS), or an InputError that says what is wrong with it."""
    if not isinstance(doc, dict):
        raise InputError(f"expected a JSON object, got {type(doc).__name__}")
    scorings = [k for k, f in FIELDS.items() if f[0] in doc]
    if len(scorings) != 1:
        raise InputError('expected {"context", "choices", "label"} (multiple choice), '
                         '{"contexts", "continuation", "label"} (partial scoring) or {"text"} (LAMBADA-style)')
    scoring = scorings[0]
    missing = [f for f in FIELDS[scoring] if f not in doc]
    if missing:
        raise InputError(f"missing {', '.join(missing)}")
    if scoring == "lambada":
        if not isinstance(doc["text"], str) or len(doc["text"].split(" ")) < 2:
            raise InputError('"text" must be a string of at least two words (the last one is the target)')
        return scoring
    options, text = (doc["choices"], doc["context"]) if scoring == "choice" else (doc["contexts"], doc["continuation"])
    if not (isinstance(options, list) and len(options) >= 2 and all(isinstance(o, str) and o for o in options)):
        raise InputError(f'"{"choices" if scoring == "choice" else "contexts"}" must be a list of at least two '
                         'non-empty strings')
    if not isinstance(text, str):
        raise InputError(f'"{"context" if scoring == "choice" else "continuation"}" must be a string')
    label = doc["label"]
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(options):
        raise InputError(f'"label" must be an integer index into the {len(options)} options, got {label!r}')
    return scoring


def task_name(path):
    """A task file's task is named after the file: mine.jsonl is the task "mine"."""
    return os.path.splitext(os.path.basename(path))[0]


def load_task_file(path, limit=0):
    """(task_name(path), scoring, docs) from a JSONL file of UTF-8 text: one doc per line, all of one scoring."""
    if not os.path.isfile(path):
        raise InputError(f"task file {path} not found")
    if not (type(limit) is int and limit >= 0):
        raise InputError(f"limit={limit!r}: use an integer >= 0 (0: every document)")
    docs, scoring = [], None
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named like any other bad line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                                 "save it as UTF-8") from None
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                k = doc_scoring(doc)
            except ValueError as e:  # json's errors and doc_scoring's are ValueErrors
                raise InputError(f"{path}:{lineno}: malformed task line: {e}") from None
            if scoring not in (None, k):
                raise InputError(f"{path}:{lineno}: a {k} line in a file of {scoring} lines: one scoring per file")
            scoring = k
            docs.append(doc)
    if not docs:
        raise InputError(f"task file {path} has no documents")
    return task_name(path), scoring, docs[:limit or None]


def load_task(name, limit=0):
    """(name, scoring, docs) of a known task, through the `datasets` package."""
    path, config, split, convert = TASKS[name]
    try:
        import datasets
    except ImportError:
        raise InputError(f"task {name} is downloaded with the `datasets` package: pip install datasets, "
                         "or pass the task as --task_file=FILE.jsonl") from None
    try:
        rows = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # offline shows up as several exception types
        raise InputError(f"could not load {path} for task {name} ({type(e).__name__}: {str(e)[:200]}); "
                         "offline? pass it as --task_file=FILE.jsonl") from None
    docs = [convert(row) for row in (rows.select(range(min(limit, len(rows)))) if limit else rows)]
    return name, doc_scoring(docs[0]), docs


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
            raise InputError(f"an empty context is scored after the end-of-text token, "
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
            raise InputError(f"continuation {continuation!r} is {len(cont)} tokens: "
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
        raise InputError("mean_stderr of no values: the task has no documents")
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


def requests_of(scoring, doc):
    if scoring == "lambada":
        words = doc["text"].split(" ")
        return [(" ".join(words[:-1]), " " + words[-1])]
    if scoring == "choice":
        return [(doc["context"], " " + c) for c in doc["choices"]]
    return [(c, " " + doc["continuation"]) for c in doc["contexts"]]


def evaluate_task(lm, name, scoring, docs, batch_size, bootstrap_iters=100000):
    """{metric: (value, stderr)} of one task. Multiple choice: acc is the argmax of the log-likelihoods of
    " " + choice after the context, acc_norm the argmax of each over len(choice) in characters; partial scoring
    (WinoGrande) fills the blank with each option and scores the rest of the sentence, acc only. LAMBADA: acc
    counts a document whose every target token is the greedy argmax, ppl = exp(-mean target log-likelihood)."""
    reqs = [requests_of(scoring, d) for d in docs]
    flat = loglikelihoods(lm, [r for rs in reqs for r in rs], batch_size, desc=name)
    if scoring == "lambada":
        lls = [ll for ll, _ in flat]
        return {"acc": mean_stderr([float(greedy) for _, greedy in flat]),
                "ppl": (math.exp(-np.mean(lls)), bootstrap_stderr(lambda s: np.exp(-s.mean(-1)), lls, bootstrap_iters))}
    acc, acc_norm, start = [], [], 0
    for d, rs in zip(docs, reqs):
        lls = np.array([ll for ll, _ in flat[start:start + len(rs)]])
        start += len(rs)
        acc.append(float(np.argmax(lls) == d["label"]))
        if scoring == "choice":
            acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in d["choices"]])) == d["label"]))
    return {"acc": mean_stderr(acc), **({"acc_norm": mean_stderr(acc_norm)} if acc_norm else {})}


# -----------------------------------------------------------------------------
# Perplexity

@torch.no_grad()
def perplexity(lm, tokens, batch_size, limit=0):
    """{loss, ppl, bpb} over `tokens` in non-overlapping segments of T = block_size tokens: segment i reads
    tokens[i*T : (i+1)*T] and predicts tokens[i*T+1 : (i+1)*T+1], so every token but the
    first is predicted exactly once. bpb, the loss in bits per UTF-8 byte of the predicted text, compares
    tokenizers (None for ids, which have no text). No stderr: lm-eval gives its weighted perplexities none."""
    T = lm.block_size
    starts = list(range(0, len(tokens) - 1, T))[:limit or None]
    if not starts:
        raise InputError(f"perplexity needs at least 2 tokens, got {len(tokens)}")
    nll, n = 0.0, 0
    batches = range(0, len(starts), batch_size)
    for b in progress(batches, desc="ppl", total=len(batches), leave=False):
        rows = [torch.from_numpy(np.asarray(tokens[s:s + T + 1], dtype=np.int64)) for s in starts[b:b + batch_size]]
        x = torch.zeros(len(rows), T, dtype=torch.long)                         # (B, T)
        y = torch.full((len(rows), T), -1, dtype=torch.long)                    # (B, T), -1: padding, not scored
        for r, row in enumerate(rows):
            x[r, :len(row) - 1], y[r, :len(row) - 1] = row[:-1], row[1:]
        lengths = (y != -1).sum(1)                                               # (B,): the last segment may be short
        n_cols = int(lengths.max())
        logits = lm.logits(x[:, :n_cols].to(lm.device), lengths)                 # (B, n_cols, vocab)
        y = y[:, :n_cols].to(logits.device)
        for r in range(len(rows)):  # one row at a time: fp32 logits of a whole batch can be large
            nll += F.cross_entropy(logits[r].float(), y[r], ignore_index=-1, reduction="sum").item()
        n += int((y != -1).sum())
    out = {"loss": nll / n, "ppl": math.exp(nll / n), "bpb": None}
    if lm.tok.name != "ids":
        scored = [int(t) for t in tokens[1:starts[-1] + T + 1]]  # every predicted token
        n_bytes = len(scored) if lm.tok.name == "bytes" else len(lm.tok.decode(scored).encode("utf-8"))
        out["bpb"] = nll / math.log(2) / n_bytes
    return out


def perplexity_tokens(settings, lm, ckpt_dataset):
    """(dataset/split, the tokens perplexity reads in lm's tokenizer: another tokenizer, a Hugging Face
    model's, reads the decoded text re-encoded, without special tokens)."""
    name = settings["dataset"] or ckpt_dataset
    if not name:
        raise InputError("perplexity needs --dataset=NAME, a dataset made by prepare_data.py (e.g. wikitext-103)")
    data_dir = dataset_dir(settings["data_root"], name)
    meta = load_meta(data_dir)
    tokens = load_tokens(data_dir, settings["split"], meta)
    label = f"{name}/{settings['split']}"
    if meta["tokenizer"] == lm.tok.name:
        return label, tokens
    if meta["tokenizer"] == "ids":
        raise InputError(f"dataset {name} holds bare token ids (no text): only a model trained on it can read it")
    return label, np.array(lm.tok.encode(get_tokenizer(meta, data_dir)[1](tokens.tolist())), dtype=np.int64)


# -----------------------------------------------------------------------------
# Reporting

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


def sweep_tables(results):
    """Per task, kind x window -> its headline metric (acc, else ppl): mean ± std over seeds."""
    ws = sorted({r["window"] for r in results if r["attn"] != "full"})
    def cell(r):
        return "-" if r is None else fmt(r["value"]) + ("" if r["seed_std"] is None else " ± " + fmt(r["seed_std"]))
    out = []
    for task, metric, cells in sweep_cells(results):
        lines = [f"\n{task} {metric}", "attn".ljust(8) + "".join(f"{w:>18}" for w in ws)]
        for kind, by_w in cells.items():
            lines.append(kind.ljust(8) + "".join(f"{cell(by_w.get(None if kind == 'full' else w)):>18}" for w in ws))
        out.append("\n".join(lines))
    return "\n".join(out)


def sweep_cells(results):
    """[(task, metric, {kind: {window: result}})], metric = acc if the task has it, else ppl."""
    out = []
    for task in dict.fromkeys(r["task"] for r in results):
        metric = "acc" if any(r["task"] == task and r["metric"] == "acc" for r in results) else "ppl"
        cells = {}
        for r in results:
            if r["task"] == task and r["metric"] == metric:
                cells.setdefault(r["attn"], {})[r["window"]] = r
        out.append((task, metric, cells))
    return out


def window_ticks(ax, ws):
    """A log x axis labelled at the windows only: log scale's own minor labels overlap."""
    from matplotlib.ticker import NullLocator
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ws, [str(w) for w in ws])


def plot_sweep(results, path):
    try:
        plt = pyplot("the sweep's plot")
    except ValueError as e:
        print(f"({e})")
        return
    panels = sweep_cells(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (task, metric, cells) in zip(axes[0], panels):
        for kind, by_w in cells.items():
            if kind == "full":
                ax.axhline(by_w[None]["value"], color="gray", ls="--", lw=1, label="full")
                continue
            ws = sorted(by_w)
            ax.errorbar(ws, [by_w[w]["value"] for w in ws], yerr=[by_w[w]["seed_std"] or 0 for w in ws],
                        marker="o", label=kind)
        window_ticks(ax, sorted({w for by_w in cells.values() for w in by_w if w is not None}))
        ax.set(xlabel="window", title=f"{task} {metric}")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"saved {path}")


if __name__ == "__main__":
    exec(open("configurator.py").read())
    run(settings)  # an InputError, which names the setting or the file and the fix, is one line (guards.one_line)
