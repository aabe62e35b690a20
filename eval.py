"""
Evaluate a language model: perplexity, zero-shot tasks scored as EleutherAI's lm-evaluation-harness 0.4.13
scores them (tasks.py), and training-free attention swaps, for our checkpoints, GPT-2 and Hugging Face LMs.

  python eval.py --out_dir=out-quick                                   # perplexity on the checkpoint's val.bin
  python eval.py --out_dir=out-quick --tasks=ppl,lambada,hellaswag     # + zero-shot tasks (needs `datasets`)
  python eval.py --out_dir=out-quick --task_file=mine.jsonl            # a task from a local JSONL file (tasks.py)
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
import socket
import urllib.parse

import numpy as np
import torch
import torch.nn.functional as F

import attention
from checkpoint import check_device, load_checkpoint
from model import ATTN_KINDS, DTYPES, GPT, GPT2_SIZES, autocast, swapped
from prepare_data import check_output_file, dataset_dir, get_tokenizer, load_meta, load_tokens, progress, pyplot
from tasks import TASKS, Tokenizer, evaluate_task, load_task, load_task_file, task_name

# -----------------------------------------------------------------------------
init_from = "resume"   # resume (out_dir/ckpt.pt), gpt2 / gpt2-medium / gpt2-large / gpt2-xl, or a Hugging Face LM
out_dir = "out"        # where resume finds ckpt.pt (and a sweep saves its plot without --json_out)
data_root = "data"     # prepared datasets live in data_root/<dataset>/
dataset = ""           # dataset for perplexity ("" = the checkpoint's)
split = "val"          # its split for perplexity (wikitext-103 also has test)
tasks = ""             # comma list of ppl, lambada, hellaswag, piqa, arc_easy, arc_challenge, winogrande ("" = ppl)
task_file = ""         # comma list (no commas in paths) of JSONL task files, each a task named after its file; no ppl
limit = 0              # at most this many documents per task, and block_size chunks for ppl (0 = all)
attn = ""              # comma list of attention kinds to swap in: full, swa, sa, sa+swa, moba ("" = the model's own)
window = None          # the swa/sa window of a swap (None = the model's own)
windows = ""           # comma list of windows to sweep, e.g. 16,32,64,128,256
moba_block = None      # MoBA's block size (None = window // moba_topk: the window's key budget)
moba_topk = 4          # MoBA's blocks per query, its own included
seeds = 1              # evaluate SA with permutation seeds 0..seeds-1: mean ± std
block_size = None      # context length cap (None = the model's block_size)
batch_size = 8         # sequences per forward pass
bootstrap_iters = 100000  # resamples for the LAMBADA ppl stderr, lm-eval's default (0 = none)
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
json_out = ""          # also write the results to this JSON file
plot = "sweep.png"     # a sweep's plot; a bare file name goes next to --json_out, else into out_dir ("" = no plot)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if k[:1].islower() and isinstance(v, (int, float, str, type(None)))}
GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256}  # what prepare_data.py writes for GPT-2 BPE


def run(cfg):
    """Evaluate as cfg (DEFAULTS with overrides) says, print the tables, return the results."""
    cfg = {**DEFAULTS, **cfg}
    ppl, names, files, kinds, ws, plot_path = check_config(cfg)
    task_list = [load_task_file(f, cfg["limit"]) for f in files] + [load_task(t, cfg["limit"]) for t in names]
    lm, ckpt_dataset = load_model(cfg)
    settings = plan(lm, kinds, ws, cfg)
    c = lm.model.config  # ours or Hugging Face's: what runs the attention of the kinds about to run
    print(attention.backend_line(cfg["device"], DTYPES[cfg["dtype"]], c.n_embd // c.n_head if hasattr(c, "n_embd") else
                           c.hidden_size // c.num_attention_heads, [s["attn"] for s in settings if s] or
                           [lm.native["attn"]], getattr(c, "sa_rule", "rank")))
    ppl_name, tokens = perplexity_tokens(cfg, lm, ckpt_dataset) if ppl else (None, None)
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
                found[name] = evaluate_task(lm, name, kind, docs, cfg["batch_size"], cfg["bootstrap_iters"])
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
        if cfg["json_out"]:
            os.makedirs(os.path.dirname(cfg["json_out"]) or ".", exist_ok=True)
            with open(cfg["json_out"], "w") as f:
                json.dump({"config": cfg, "results": results, "per_seed": rows}, f, indent=1)
    except OSError as e:  # a full disk
        raise ValueError(f"cannot write {e.filename or cfg['json_out']}: {e.strerror or e} "
                         "(the tables above are complete)") from None
    return results


def check_config(cfg):
    """(ppl?, tasks, task files, kinds, windows, plot path) asked for, after checking every setting, up front."""
    def check(key, ok, rule):  # configurator.py's check_setting, on cfg: tests call run(cfg) with a dict
        if not ok:
            raise ValueError(f"{key}={cfg[key]!r}: {rule}")

    repeat = lambda xs: next((x for i, x in enumerate(xs) if x in xs[:i]), None)  # noqa: E731

    def items(key, parse=str, known=None):  # a repeat would be averaged in with the first, as another seed
        try:
            got = [parse(x.strip()) for x in cfg[key].split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{key} must be a comma list of integers, got {cfg[key]!r}") from None
        check(key, repeat(got) is None, f"lists {repeat(got)!r} twice: give each once (a repeat would be averaged "
              "in as another seed)")
        unknown = next((x for x in got if known and x not in known), None)
        check(key, unknown is None, f"unknown {unknown!r}: choose from {', '.join(known or ())}")
        return got
    names, files = items("tasks", known=("ppl", *TASKS)), items("task_file")
    kinds, ws = items("attn", known=ATTN_KINDS), items("windows", int)
    tasks = [t for t in names if t != "ppl"]
    clash = repeat(tasks + [task_name(f) for f in files])  # results are keyed by a task's name (ppl's by its data)
    check("task_file", clash is None, f"two tasks are named {clash!r} (a task is named after its file): rename one")
    if ws and cfg["window"] is not None:
        raise ValueError("give --window or --windows, not both")
    ws = [attention.check_int(w) for w in (ws or ([cfg["window"]] if cfg["window"] is not None else []))]
    for key in ("moba_topk", "seeds", "batch_size", "moba_block", "block_size", "limit", "bootstrap_iters"):
        least = 0 if key in ("limit", "bootstrap_iters") else 1
        check(key, cfg[key] is None and key in ("moba_block", "block_size") or type(cfg[key]) is int
              and cfg[key] >= least, f"use an integer >= {least}")
    check_device(cfg["device"], cfg["dtype"])
    if cfg["dataset"]:
        dataset_dir(cfg["data_root"], cfg["dataset"])
    plot_path = os.path.join("" if os.path.dirname(cfg["plot"]) else os.path.dirname(cfg["json_out"]) or cfg["out_dir"],
                             cfg["plot"]) if cfg["plot"] else ""
    for key, path in (("json_out", cfg["json_out"]), ("plot", plot_path if len(ws) > 1 else "")):
        if path:  # before the long part
            check_output_file(key, path)
    return "ppl" in names or not (names or files), tasks, files, kinds, ws, plot_path


def plan(lm, kinds, ws, cfg):
    """The attention settings to evaluate: [None] = the model as it is, else lm.use() kwargs. An sa+swa model
    keeps its kind (model.swapped says why), so that its sweep varies the window of both its paths."""
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
    for setting in settings if isinstance(lm, OurLM) else []:  # every swap checked before the first one runs
        swapped(lm.model.config, **setting)
    return settings


# -----------------------------------------------------------------------------
# Models: ours (a checkpoint or GPT-2) and Hugging Face's, behind one interface:
# tok, block_size, device, native (its own attention), logits(idx, lengths), use(setting), seed(s)

class OurLM:

    def __init__(self, model, tok, block_size, device, ctx):
        self.model, self.tok, self.device, self.ctx = model.eval(), tok, device, ctx
        self.block_size = min(block_size or model.config.block_size, model.config.block_size)
        kind = model.config.attn
        self.native = {"attn": kind, **({"window": model.config.window} if kind in ("swa", "sa", "sa+swa") else {})}

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
    cfg = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(cfg, attr, None) is not None:
            return int(getattr(cfg, attr))
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


def register_hf_attention(attn, window=None, moba_block=64, moba_topk=4, generator=None):
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
        raise ValueError("Hugging Face models need transformers: pip install transformers") from None
    if attn not in ("swa", "sa", "moba"):
        raise ValueError(f"a Hugging Face model can run swa, sa or moba, not {attn!r}"
                         + (": sa+swa needs gates trained with the model" if attn == "sa+swa" else ""))
    sizes = dict(moba_block=moba_block, moba_topk=moba_topk) if attn == "moba" else dict(window=window)
    for key, value in sizes.items():
        attention.check_int(value, key)
    generator = torch.Generator() if generator is None else generator
    name = f"moba_b{moba_block}_k{moba_topk}" if attn == "moba" else f"{attn}_w{window}"
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
            return attention.moba_attention(q, k, v, moba_block, moba_topk)
        return attention.stochastic_attention(q, k, v, window, draw_perm(lengths, q.shape[2]).to(q.device))

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=True, **kwargs):
        unsupported = [f"{k}={v!r}" for k, v in kwargs.items() if k not in HF_IGNORED and v not in (None, False)]
        unsupported += [f"dropout={dropout}"] * bool(dropout) + ["is_causal=False"] * (is_causal is False)
        if unsupported:
            raise ValueError(f"the {name} attention does not implement {', '.join(unsupported)}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"the {name} attention takes transformers' padding mask, "
                             f"not a {attention_mask.dim()}D mask")
        (B, H, T, D), S = query.shape, key.shape[2]
        k = key.repeat_interleave(H // key.shape[1], dim=1)                      # (B, H, S, D)
        v = value.repeat_interleave(H // key.shape[1], dim=1)                    # (B, H, S, D)
        q = query if scaling is None else query * (scaling * math.sqrt(D))       # (B, H, T, D)
        if S != T:  # decoding against a KV cache
            if T != 1:
                raise ValueError(f"{name} attention runs a full pass (T keys for T queries) or decodes one token "
                                 f"against a cache; got {T} queries and {S} keys")
            keep = torch.ones(B, S, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask
            if attn == "swa":
                own = kwargs.get("sliding_window")
                if own is not None and own < window:
                    raise ValueError(f"this model's cache keeps its sliding_window={own} keys: "
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


def hub_offline(name):
    """True, and Hugging Face's offline mode (HF_HUB_OFFLINE=1: the local cache only) set, when
    name is no local path and the hub cannot be reached; transformers would otherwise retry
    5 times, for about 30 s, then raise. Set before transformers is imported, where it counts."""
    if os.path.exists(name) or os.environ.get("HF_HUB_OFFLINE") == "1":
        return os.environ.get("HF_HUB_OFFLINE") == "1"
    hub = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((hub.hostname, hub.port or 443), timeout=5).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        return True


def load_model(cfg):
    """(lm, dataset of the checkpoint or "") for cfg["init_from"]."""
    dev, name, ctx = cfg["device"], cfg["init_from"], autocast(cfg["device"], cfg["dtype"])
    def ours(model, meta, source):  # our GPT, with meta's tokenizer (meta from source)
        encode, decode = get_tokenizer(meta, source)
        return OurLM(model, Tokenizer(meta["tokenizer"], encode, decode, meta.get("eot"), encode), cfg["block_size"],
                     dev, ctx)
    if name == "resume":
        model, ckpt = load_checkpoint(path := os.path.join(cfg["out_dir"], "ckpt.pt"), dev, require=("meta", "config"))
        return ours(model, ckpt["meta"], path), ckpt["config"].get("dataset", "")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"--init_from={name}: the directory holds no model (a Hugging Face one has a config.json; "
                         f"a train.py out_dir loads with --init_from=resume --out_dir={name})")
    offline = hub_offline(name)
    try:
        if name in GPT2_SIZES:
            return ours(GPT.from_pretrained(name).to(dev), GPT2_META, name), ""
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise ValueError(f"--init_from={name} loads a Hugging Face model: pip install transformers") from None
        hf_tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[cfg["dtype"]]).to(dev)
    except OSError as e:  # not on the hub, not in the cache, or offline
        why = ("the Hugging Face hub is unreachable and it is not in the local cache" if offline
               else str(e).splitlines()[0][:200])
        raise ValueError(f"--init_from={name}: cannot load it ({why}); go online once, or give a local path") from None
    prefix = hf_tok.bos_token_id if hf_tok.bos_token_id is not None else hf_tok.eos_token_id  # lm-eval's prefix token
    prefix_text = hf_tok.decode(prefix) if prefix is not None else None
    tok = Tokenizer(f"hf:{name}", lambda s: hf_tok.encode(s, add_special_tokens=False), hf_tok.decode, prefix,
                    # lm-eval's tok_encode: the tokenizer's defaults, unless the text starts with the prefix token
                    lambda s: hf_tok.encode(s, add_special_tokens=not (prefix_text and s.startswith(prefix_text))))
    return HFLM(model, tok, cfg["block_size"], dev, hf_tok.model_max_length), ""


# -----------------------------------------------------------------------------
# Perplexity

@torch.no_grad()
def perplexity(lm, tokens, batch_size, limit=0):
    """{loss, ppl, bpb} over `tokens` in non-overlapping chunks of T = block_size tokens: chunk i reads
    tokens[i*T : (i+1)*T] and predicts tokens[i*T+1 : (i+1)*T+1], so every token but the
    first is predicted exactly once. bpb, the loss in bits per UTF-8 byte of the predicted text, compares
    tokenizers (None for ids, which have no text). No stderr: lm-eval gives its weighted perplexities none."""
    T = lm.block_size
    starts = list(range(0, len(tokens) - 1, T))[:limit or None]
    if not starts:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(tokens)}")
    nll, n = 0.0, 0
    batches = range(0, len(starts), batch_size)
    for b in progress(batches, desc="ppl", total=len(batches), leave=False):
        rows = [torch.from_numpy(np.asarray(tokens[s:s + T + 1], dtype=np.int64)) for s in starts[b:b + batch_size]]
        x = torch.zeros(len(rows), T, dtype=torch.long)                         # (B, T)
        y = torch.full((len(rows), T), -1, dtype=torch.long)                    # (B, T), -1: padding, not scored
        for r, row in enumerate(rows):
            x[r, :len(row) - 1], y[r, :len(row) - 1] = row[:-1], row[1:]
        lengths = (y != -1).sum(1)                                               # (B,): the last chunk may be short
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


def perplexity_tokens(cfg, lm, ckpt_dataset):
    """(dataset/split, the tokens perplexity reads in lm's tokenizer: another tokenizer, a Hugging Face
    model's, reads the decoded text re-encoded, without special tokens)."""
    name = cfg["dataset"] or ckpt_dataset
    if not name:
        raise ValueError("perplexity needs --dataset=NAME, a dataset made by prepare_data.py (e.g. wikitext-103)")
    data_dir = dataset_dir(cfg["data_root"], name)
    meta = load_meta(data_dir)
    tokens = load_tokens(data_dir, cfg["split"], meta)
    label = f"{name}/{cfg['split']}"
    if meta["tokenizer"] == lm.tok.name:
        return label, tokens
    if meta["tokenizer"] == "ids":
        raise ValueError(f"dataset {name} holds bare token ids (no text): only a model trained on it can read it")
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
    run(config)  # a ValueError, which names the setting or the file and the fix, is one line (configurator.py)
