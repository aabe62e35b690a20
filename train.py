"""
Train a GPT with full, SWA, SA, SA+SWA or MoBA attention, after nanoGPT.

One process (a CPU, or one GPU); then a resume from the last checkpoint, with the same config and a later max_iters:
  python prepare_data.py && python train.py config/quick.py
  python train.py config/quick.py --attn=swa --window=64 --out_dir=out-swa
  python train.py config/quick.py --init_from=resume --max_iters=2000
DDP, on one node with 8 GPUs, or on two nodes:
  torchrun --standalone --nproc_per_node=8 train.py config/paper_360m.py
  torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=IP --master_port=1234 train.py ...

Every eval after iteration 0 writes out_dir/ckpt.pt and appends to out_dir/log.jsonl. The checkpoint holds every
RNG state of every rank, so that a resumed run is bitwise the run that was never stopped. Nothing is lost on the
way: a second run into the same out_dir is refused, a diverged (NaN) loss stops the run before anything of it is
saved, and a run from scratch replaces an old checkpoint only when told to, with --overwrite=True.
"""
import fcntl
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import attention
from checkpoint import check_device, load_checkpoint, save_checkpoint
from model import DTYPES, GPT, GPTConfig, autocast
from prepare_data import check_writable, dataset_dir, load_meta, load_tokens, mqar_batch, mqar_targets

# -----------------------------------------------------------------------------
# The defaults are one run on one A100: a GPT-2-small-sized (124M) SA+SWA model on FineWeb-Edu, 5000 iterations of
# 0.5M tokens (2.6B tokens). Its peak, about 20.5 GiB in eager bf16 (gpu_check.memory_estimate), fits 40 GB.
# I/O
out_dir = "out"                 # ckpt.pt and log.jsonl go here
eval_interval = 250             # evaluate, log and checkpoint every this many iterations (and at the end)
log_interval = 10               # print the training loss and speed every this many iterations
eval_iters = 50                 # batches per split per evaluation (the same batches every time)
eval_only = False               # evaluate once and exit
always_save_checkpoint = True   # save at every eval; False: only when val loss improves
init_from = "scratch"           # "scratch" or "resume" (from out_dir/ckpt.pt)
overwrite = False               # scratch: replace a ckpt.pt already in out_dir (at the first checkpoint), not refuse
# data
dataset = "fineweb-edu"         # data_root/<dataset>/ from prepare_data.py
data_root = "data"
gradient_accumulation_steps = 32  # micro-steps per iteration, the total over DDP ranks
batch_size = 8                  # sequences per micro-step per rank
block_size = 2048               # tokens per sequence (mqar: the data's seq_len)
copy_task = False               # far copying: each sequence is a random block_size/2-token chunk, then that chunk again
# model: one global per GPTConfig field (model.py; block_size is above), passed to it by name. These are the run's
# values; GPTConfig's defaults are the model's, GPT-2 small's (block_size 1024, where this run trains on 2048).
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
attn = "sa+swa"                 # full | swa | sa | sa+swa | moba
window = 256                    # SWA/SA keys per query
moba_block = 64
moba_topk = 4
sa_perm = "layer"               # layer | head
sa_rule = "rank"                # rank (the paper) | value (decodable from a KV cache; attention.py's docstring)
pos_emb = "rope"                # rope | learned
rope_base = 10000.0
vocab_size = 0                  # 0: the data's vocab_size, padded up to a multiple of 64 (50257 -> 50304)
# AdamW, warmup and cosine decay
learning_rate = 6e-4
max_iters = 5000                # iterations of batch_size * block_size * gradient_accumulation_steps tokens
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0                 # clip the gradient norm to this; 0: off
decay_lr = True
warmup_iters = 200
lr_decay_iters: int | None = None  # None: max_iters
min_lr = 6e-5
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
# autocast: float32 | bfloat16 | float16 (with loss scaling: GPUs without bf16, a T4); on a CPU bf16 is ~10x slower
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
compile: bool | None = None     # torch.compile the model; None: on CUDA (as nanoGPT), not on the CPU (slow to compile)
backend = "auto"                # attention.BACKEND: auto (the Triton kernel where it runs), torch, triton or reference
ddp_backend = ""                # torch.distributed's: "" = nccl on CUDA, gloo on the CPU
seed = 1337
# -----------------------------------------------------------------------------
exec(open("configurator.py").read())  # overrides from config files and --key=value; sets `config` (in checkpoints)
# -----------------------------------------------------------------------------


# bad settings stop here with one line (configurator.py's check_setting), before any data is read or anything written
for key in ("eval_interval", "log_interval", "eval_iters", "batch_size", "gradient_accumulation_steps"):
    check_setting(key, config[key] >= 1, "use an integer >= 1")
for key in ("max_iters", "warmup_iters", "seed") + (("lr_decay_iters",) if lr_decay_iters is not None else ()):
    check_setting(key, config[key] >= 0, "use an integer >= 0")
check_setting("learning_rate", 0 < learning_rate <= torch.finfo(torch.float32).max,
              "use a value > 0 (a negative one is gradient ascent) that fp32 holds (AdamW's steps are fp32)")
for key in ("min_lr", "weight_decay", "grad_clip"):
    check_setting(key, config[key] >= 0, "use a value >= 0")
for key in ("beta1", "beta2"):
    check_setting(key, 0 <= config[key] < 1, "AdamW's betas lie in [0, 1)")
check_setting("vocab_size", vocab_size >= 0, "use 0 (the data's vocabulary, padded) or at least the data's vocab_size")
check_setting("copy_task", not copy_task or block_size % 2 == 0, "it needs an even block_size (two equal halves)")
check_setting("init_from", init_from in ("scratch", "resume"), "use scratch or resume")
check_setting("backend", backend in attention.BACKENDS, f"use one of {', '.join(attention.BACKENDS)}")
ddp_backends = [b for b in dist.Backend.backend_list if b != "undefined"]
check_setting("ddp_backend", ddp_backend in ["", *ddp_backends], f"use \"\" (nccl on CUDA, gloo on the CPU) or one of "
              f"{', '.join(ddp_backends)}")
check_device(device, dtype)
data_dir = dataset_dir(data_root, dataset)
# the model's settings, one global per GPTConfig field, are GPTConfig's to check (vocab_size is the data's, later)
missing = [f.name for f in fields(GPTConfig) if f.name not in config]
if missing:
    raise ValueError(f"train.py has no global for GPTConfig.{missing[0]}: add `{missing[0]} = ...` to its model "
                     "settings")
model_args = {f.name: config[f.name] for f in fields(GPTConfig)}
GPTConfig(**{**model_args, "vocab_size": vocab_size or 1})
check_setting("out_dir", out_dir != "", "name a directory")
check_setting("out_dir", not os.path.exists(out_dir) or os.path.isdir(out_dir), "it is a file, not a directory")
check_writable(out_dir)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if init_from == "scratch" and os.path.exists(ckpt_path) and not overwrite:
    sys.exit(f"{ckpt_path} exists: continue it with --init_from=resume, train in a new --out_dir, "
             "or replace it with --overwrite=True")

# DDP: torchrun sets RANK. Each rank draws its own SA permutations (seeded by
# seed and rank), just as each micro-step draws new ones. So an iteration of N
# ranks x K micro-steps averages gradients over N*K independent permutation
# draws, the same count as one process running N*K micro-steps, and the
# permutation noise in the gradient shrinks with the global batch. Sharing one
# permutation across ranks would instead tie the run's statistics to its GPU count.
ddp = "RANK" in os.environ
rank, local_rank, world_size = 0, 0, 1
if ddp:
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend=ddp_backend or ("nccl" if device.startswith("cuda") else "gloo"))
    if gradient_accumulation_steps % world_size:
        sys.exit(f"gradient_accumulation_steps={gradient_accumulation_steps} must be divisible by "
                 f"the {world_size} ranks")
    gradient_accumulation_steps //= world_size
master = rank == 0
device_type = "cuda" if device.startswith("cuda") else "cpu"
ctx = autocast(device, dtype)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

# data
config["data_dir"] = data_dir
meta = load_meta(data_dir)
data = {split: load_tokens(data_dir, split, meta) for split in ("train", "val")}
# MQAR (prepare_data.py): whole sequences, fresh ones for training (get_batch), answers scored (estimate_loss)
mqar = meta.get("mqar")
T = mqar["seq_len"] if mqar else block_size  # tokens per training sequence
if mqar and copy_task:
    sys.exit(f"copy_task=True builds its sequences from text: {data_dir} holds MQAR sequences")
if mqar and block_size < T:
    sys.exit(f"block_size={block_size} is smaller than the MQAR sequences ({T} tokens): use --block_size={T}")
if mqar and attn == "swa" and n_layer * (window - 1) < mqar["min_gap"] and master:
    print(f"mqar: SWA's reach {n_layer} x ({window} - 1) < min_gap {mqar['min_gap']}: it can only guess the answers")
for split, tokens in data.items():
    if len(tokens) < T + 1:
        sys.exit(f"block_size={T} is larger than the data: {data_dir}/{split}.bin holds only {len(tokens)} tokens; "
                 "lower --block_size or prepare more data")
data_vocab = meta["vocab_size"]
vocab_size = vocab_size or math.ceil(data_vocab / 64) * 64
if vocab_size < data_vocab:
    sys.exit(f"vocab_size={vocab_size} is smaller than the vocabulary of {data_dir} ({data_vocab}): use --vocab_size=0")
config["vocab_size"] = model_args["vocab_size"] = vocab_size


def get_batch(split, gen):
    """batch_size sequences drawn with the generator gen: random windows, or whole
    MQAR sequences whose targets are the answers only, fresh ones for training
    (seeded from gen, so a resumed run draws the same) and val.bin's for val."""
    tokens = data[split]
    if mqar and split == "train":  # fresh sequences, from a numpy Generator seeded by gen
        x, y = mqar_batch(np.random.default_rng(torch.randint(2**62, (), generator=gen).item()), batch_size, meta)
    elif mqar:  # whole stored sequences; the targets are the answers only
        starts = torch.randint(len(tokens) // T, (batch_size,), generator=gen).numpy() * T
        x = np.stack([tokens[i:i + T] for i in starts]).astype(np.int64)             # (B, T)
        y = mqar_targets(x, meta)
    elif copy_task:  # every target of the second half repeats the token block_size/2 back
        starts = torch.randint(len(tokens) - T // 2, (batch_size,), generator=gen).numpy()
        chunk = np.stack([tokens[i:i + T // 2] for i in starts]).astype(np.int64)      # (B, T/2)
        x = np.concatenate([chunk, chunk], 1)                                         # (B, T)
        y = np.concatenate([x[:, 1:], np.full((batch_size, 1), -1)], 1)               # (B, T), the last has no target
    else:
        starts = torch.randint(len(tokens) - T, (batch_size,), generator=gen).numpy()
        x = np.stack([tokens[i:i + T] for i in starts]).astype(np.int64)             # (B, T)
        y = np.stack([tokens[i + 1:i + 1 + T] for i in starts]).astype(np.int64)     # (B, T)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


# model: all ranks build identical weights from `seed`; then each rank gets its own
# streams for dropout, data sampling and SA permutations
gptconf = GPTConfig(**model_args)
# a model too large stops here in one line, not in the OOM killer: its weights, gradients and AdamW's two
# moments (16 bytes per fp32 parameter) must fit in the device's memory. n_params is a lower bound.
n_params = n_layer * 12 * n_embd ** 2 + vocab_size * n_embd  # the blocks' four matrices, the embedding
memory = (torch.cuda.mem_get_info(device)[1] if device_type == "cuda"
          else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
if 16 * n_params > memory:
    sys.exit(f"n_layer={n_layer}, n_embd={n_embd}: {n_params / 1e9:,.1f}B parameters need {16 * n_params / 2**30:,.0f} "
             f"GiB for weights, gradients and AdamW's moments; {device} has {memory / 2**30:,.0f} GiB: make it smaller")
logits = 4 * batch_size * T * vocab_size  # a micro-step's fp32 logits alone (and as much again for their gradient)
check_setting("batch_size", 16 * n_params + 2 * logits <= memory, f"{batch_size} sequences of {T} tokens need "
              f"{2 * logits / 2**30:,.0f} GiB for their logits alone; {device} has {memory / 2**30:,.0f} GiB: use "
              "fewer")
torch.manual_seed(seed)
dropout_seed, sampler_seed, sa_seed = np.random.SeedSequence([seed, rank]).generate_state(3).tolist()
raw_model = GPT(gptconf, sa_seed=sa_seed).to(device)
torch.manual_seed(dropout_seed)
sampler = torch.Generator().manual_seed(sampler_seed)
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
# fp16 gradients underflow unless the loss is scaled; the checkpoint keeps the scaler's state
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
iter_num, best_val_loss = 0, float("inf")

if init_from == "resume":
    # checks every entry read below (their types and ranges); the weights then go into our model
    _, ckpt = load_checkpoint(ckpt_path, require=("optimizer", "iter_num", "best_val_loss", "config", "meta", "rng"))
    old = ckpt["meta"]  # the data must mean what it meant: the same tokenizer, the same vocabulary
    if any(old.get(k) != meta.get(k) for k in ("tokenizer", "vocab_size", "chars")):
        sys.exit(f"{ckpt_path} was trained on {ckpt['config'].get('data_dir')} ({old.get('tokenizer')} tokens, "
                 f"vocabulary {old.get('vocab_size')}), but {data_dir} has another vocabulary ({meta['tokenizer']} "
                 f"tokens, {meta['vocab_size']}): resume on the data it was trained on, or start a new out_dir")
    saved_args = ckpt["model_args"]
    diff = [k for k in model_args if k != "dropout" and saved_args.get(k) != model_args[k]]
    if diff:
        sys.exit(f"{ckpt_path} was trained with {', '.join(f'{k}={saved_args.get(k)!r}' for k in diff)}, but this run "
                 f"asks for {', '.join(f'{k}={model_args[k]!r}' for k in diff)}: resume with the original config, "
                 "or train from scratch in another out_dir")
    raw_model.load_state_dict(ckpt["model"])
    try:  # another optimizer's state (SGD's) can load, then fail at the first step: AdamW's entries are checked
        optimizer.load_state_dict(ckpt["optimizer"])
        why = next((f"no {k!r}" for st in optimizer.state.values() for k in ("step", "exp_avg", "exp_avg_sq")
                    if k not in st), None)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = str(e).splitlines()[0][:120]
    if why:
        sys.exit(f"{ckpt_path}: its 'optimizer' is not this model's AdamW state ({why}): it was written by other "
                 "code; resume from a checkpoint that train.py wrote")
    if ckpt.get("scaler"):  # fp16: the loss scale and its growth tracker
        scaler.load_state_dict(ckpt["scaler"])
    iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
    check_setting("max_iters", max_iters >= iter_num or eval_only, f"{ckpt_path} is at iteration {iter_num} already: "
                  "raise max_iters to train on")
    states = ckpt["rng"]
    if rank < len(states):
        s = states[rank]
        torch.set_rng_state(s["torch"])
        if "cuda" in s and device_type == "cuda":
            torch.cuda.set_rng_state(s["cuda"])
        np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], np.uint32), *s["numpy"][2:]))
        random.setstate(s["python"])
        sampler.set_state(s["sampler"])
        raw_model.sa_state.copy_(s["sa"])
    else:
        print(f"rank {rank}: {ckpt_path} has RNG states for {len(states)} ranks only; this rank continues "
              "from fresh seeds, so the run is no longer an exact continuation")
    del ckpt
resumed = iter_num if init_from == "resume" else None  # the iteration ckpt_path holds, until this run saves

compiled = device_type == "cuda" if compile is None else compile
model = torch.compile(raw_model) if compiled else raw_model   # evaluation runs this one, on the master only
train_model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None,
                  broadcast_buffers=False) if ddp else model  # the RoPE tables are constant: nothing to broadcast


def rng_states():
    """Every RNG state of every rank. numpy's and python's global generators are not drawn
    from here, but are kept too, so code that does draw from them stays exactly resumable."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
             "python": random.getstate(), "sampler": sampler.get_state(), "sa": raw_model.sa_state.clone()}
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    if not ddp:
        return [state]
    states = [None] * world_size
    dist.all_gather_object(states, state)
    return [{k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for s in states]


@torch.no_grad()
def estimate_loss():
    """Mean loss (and MQAR answer accuracy) per split over eval_iters batches. Evaluation uses
    its own fixed batches and SA permutations and restores the SA generator afterwards, so it
    draws nothing from the training streams: with or without it, training is the same."""
    out = {}
    sa_state = raw_model.sa_state.clone()
    model.eval()
    for split in ("train", "val"):
        gen = torch.Generator().manual_seed(seed)
        raw_model.seed_sa(seed)
        losses, correct, answers, halves = [], 0, 0, []
        for _ in range(eval_iters):
            X, Y = get_batch(split, gen)
            with ctx:
                logits, loss = model(X, Y)
            losses.append(loss.item())
            if copy_task:  # targets 0 .. T/2-2 continue the chunk; from T/2-1 on they copy it
                nll = F.cross_entropy(logits.float().transpose(1, 2), Y, ignore_index=-1, reduction="none")  # (B, T)
                halves.append((nll[:, :T // 2 - 1].mean().item(), nll[:, T // 2 - 1:-1].mean().item()))
            if mqar:
                scored = Y != -1
                correct += (logits.argmax(-1)[scored] == Y[scored]).sum().item()
                answers += scored.sum().item()
        out[f"{split}_loss"] = sum(losses) / len(losses)
        if mqar:
            out[f"{split}_acc"] = correct / answers
        if copy_task:
            out[f"{split}_first"], out[f"{split}_second"] = np.mean(halves, 0).tolist()
    raw_model.sa_state.copy_(sa_state)
    model.train()
    return out


def get_lr(it):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters."""
    decay_iters = max_iters if lr_decay_iters is None else lr_decay_iters
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def read_log(path):
    """log.jsonl's records. Blank lines are skipped, and so is a last line cut short (a killed run);
    any other line that is not a JSON record stops the run with one line naming it."""
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is no record either, and is named like one
        lines = f.readlines()
    records = []
    for i, raw in enumerate(lines, 1):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip() or (i == len(lines) and not line.endswith("\n")):
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError too
            record = None
        if not isinstance(record, dict) or type(record.get("iter")) is not int or record["iter"] < 0:
            sys.exit(f"{path}:{i} is not a log record ({line.strip()[:60]!r}): delete that line, then resume again")
        records.append(record)
    return records


tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * T
log_path = os.path.join(out_dir, "log.jsonl")
# --overwrite=True: the old ckpt.pt and log.jsonl stay whole until this run saves its first
# checkpoint; until then it logs to log_path + ".new" (which save() moves into place)
new_log = log_path + ".new" if init_from == "scratch" and os.path.exists(ckpt_path) else None
log_file, saved = None, None  # saved: the iteration of the last checkpoint this run wrote
if master:
    try:
        os.makedirs(out_dir, exist_ok=True)
        # two runs into one out_dir would splice their logs and checkpoints: the master locks it for its life.
        # The OS frees the lock when the process ends, even by SIGKILL, so a killed run leaves none stuck
        lock = open(os.path.join(out_dir, ".lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if init_from == "scratch" and os.path.exists(ckpt_path) and not new_log:
            sys.exit(f"{ckpt_path} was written by another run after this one started: train in a new --out_dir")
        for stale in (ckpt_path + ".tmp", log_path + ".new"):  # half-written files of an interrupted run
            if os.path.exists(stale):
                os.remove(stale)
        if init_from == "resume" and os.path.exists(log_path):
            # cut the log back to the checkpoint's eval, which this run repeats: a killed run may have
            # logged later iterations, which this run redoes. The log then reads as one run.
            records = read_log(log_path)
            with open(log_path + ".tmp", "w") as f:
                for r in records:
                    if r["iter"] < iter_num or (r["iter"] == iter_num and "val_loss" not in r):
                        print(json.dumps(r), file=f)
            os.replace(log_path + ".tmp", log_path)
        log_file = open(new_log or log_path, "a" if init_from == "resume" else "w")
    except BlockingIOError:
        sys.exit(f"out_dir={out_dir} is in use by another train.py run (it holds {out_dir}/.lock): wait for it to "
                 "end, or train in another --out_dir")
    except OSError as e:
        sys.exit(f"cannot write to out_dir={out_dir}: {e.strerror or e}")
    print(f"{dataset}: {len(data['train']):,} train / {len(data['val']):,} val tokens; "
          f"{raw_model.get_num_params() / 1e6:.2f}M "
          f"parameters, attn={attn}, window={window}; {tokens_per_iter:,} tokens per iteration "
          f"({world_size} x {gradient_accumulation_steps} x {batch_size} x {T}) on {device}")
attention.BACKEND = backend
attention_line = attention.backend_line(device, DTYPES[dtype], n_embd // n_head, [attn], sa_rule)  # each rank's GPU
if master:
    print(attention_line)


def log(record):
    """Append a record to log.jsonl: an eval's {iter, train_loss, val_loss, lr, elapsed_s} (+ train_acc, val_acc on
    MQAR; the loss of each half on the copy task), or training's {iter, loss, lr, ms_per_iter, tok_per_s, mfu
    (CUDA only), elapsed_s}."""
    try:
        print(json.dumps(record), file=log_file, flush=True)
    except OSError as e:
        sys.exit(f"cannot write {log_file.name}: {e.strerror or e} (disk full?); the last checkpoint is "
                 f"{ckpt_path if saved is not None else 'none'}")


def save(states):
    """Write ckpt.pt atomically; the first save of an --overwrite run then moves its log into place. Besides the
    weights, the optimizer, the scaler (fp16), the config and the data's meta.json, it holds `states`, every RNG
    of every rank (rng_states), so that a resumed run is bitwise the run that was never stopped (tested on the
    CPU) as long as lr_decay_iters stays the same."""
    global new_log, log_file, saved
    pending = []  # a Ctrl-C meanwhile waits until the checkpoint and its log are whole
    ctrl_c = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
    try:
        save_checkpoint({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "model_args": raw_model.model_args(), "iter_num": iter_num,
                         "best_val_loss": best_val_loss, "config": config, "meta": meta, "rng": states}, ckpt_path)
        if new_log:
            log_file.close()
            os.replace(new_log, log_path)
            log_file, new_log = open(log_path, "a"), None
        saved = iter_num
    except (OSError, RuntimeError) as e:  # torch.save's writer raises RuntimeError on a full disk
        for partial in (ckpt_path + ".tmp", new_log):  # an --overwrite run's log goes with its checkpoint
            if partial and os.path.exists(partial):
                os.remove(partial)
        sys.exit(f"cannot write {ckpt_path}: {str(e).splitlines()[0][:200]} (disk full?); "
                 + (f"it still holds iteration {saved}" if saved is not None else "no checkpoint was saved"))
    finally:
        signal.signal(signal.SIGINT, ctrl_c)
    if pending:
        ctrl_c(signal.SIGINT, None)


def stop_if_diverged(loss, what):
    """A NaN or inf loss stops the run in one line before anything of it is saved: the last checkpoint stays.
    Under DDP the ranks' values are summed first, so all ranks stop at the same iteration and none waits on
    a stopped one. (With fp16, an inf gradient is normal, the GradScaler skips that step; a loss is not.)"""
    loss = torch.as_tensor(loss, dtype=torch.float32, device=device)
    if ddp:
        dist.all_reduce(loss)
    if not math.isfinite(loss.item()):
        kept = f"{ckpt_path} keeps iteration {saved}" if saved is not None else "this run saved no checkpoint"
        sys.exit(f"iteration {iter_num}: the {what} is {loss.item()}: the run diverged (lower --learning_rate?); {kept}"
                 if master else 1)


def interrupted(signum, frame):
    """Ctrl-C: one line (configurator.py prints a KeyboardInterrupt's message) saying where the run resumes from."""
    kept = saved if saved is not None else resumed
    args = [a for a in sys.argv[1:] if not a.startswith("--init_from=")] + ["--init_from=resume"]
    raise KeyboardInterrupt(f"interrupted at iteration {iter_num}: " + (
        f"{ckpt_path} holds iteration {kept}; continue it with `python train.py {shlex.join(args)}`"
        if kept is not None else "no checkpoint of this run was saved"))


signal.signal(signal.SIGINT, interrupted)
t_start = t_last = time.time()
iters_since_log = 0
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr

    if iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only:
        states = rng_states()  # a collective under DDP: every rank takes part
        ev = estimate_loss() if master else {}
        stop_if_diverged(ev.get("train_loss", 0.0) + ev.get("val_loss", 0.0), "eval's train + val loss")  # so is this
        if master:
            acc = f", acc train {ev['train_acc']:.3f} val {ev['val_acc']:.3f}" if mqar else ""
            acc += f", val halves {ev['val_first']:.4f} / {ev['val_second']:.4f}" if copy_task else ""
            print(f"step {iter_num}: train loss {ev['train_loss']:.4f}, val loss {ev['val_loss']:.4f}{acc}")
            log({"iter": iter_num, **ev, "lr": lr, "elapsed_s": round(time.time() - t_start, 2)})
            best_val_loss = min(best_val_loss, ev["val_loss"])
            if iter_num > 0 and not eval_only and (always_save_checkpoint or ev["val_loss"] <= best_val_loss):
                save(states)
        t_last, iters_since_log = time.time(), 0  # the speed below leaves out evaluation time
    if iter_num >= max_iters or eval_only:
        break

    # one iteration. Each micro-step fetches its own batch (no prefetch across
    # iterations), so the sampler state in a checkpoint is exactly where the next
    # iteration starts
    losses = torch.zeros((), device=device)  # this iteration's, summed: checked before the step
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # all-reduce the gradients on the last micro-step only
            train_model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch("train", sampler)
        with ctx:
            _, loss = train_model(X, Y)
        scaler.scale(loss / gradient_accumulation_steps).backward()
        losses += loss.detach()
    stop_if_diverged(losses, "training loss")
    if grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)
    scaler.step(optimizer)  # with fp16, skipped when a gradient overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    iters_since_log += 1

    if iter_num % log_interval == 0 and master:
        lossf = loss.item()  # the last micro-step's loss: a sync point, so the timing below is honest
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = (time.time() - t_last) / iters_since_log
        tok_s = tokens_per_iter / dt
        # mfu is measured against an A100's peak: on a CPU it means nothing
        mfu = raw_model.estimate_mfu(tokens_per_iter // world_size, dt, T) if device_type == "cuda" else None
        print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {dt * 1000:.0f} ms/iter, {tok_s:,.0f} tok/s"
              + (f", mfu {mfu * 100:.2f}% (of an A100's bf16 peak)" if mfu is not None else ""))
        log({"iter": iter_num, "loss": lossf, "lr": lr, "ms_per_iter": round(dt * 1000, 2), "tok_per_s": round(tok_s),
             "mfu": mfu, "elapsed_s": round(time.time() - t_start, 2)})
        t_last, iters_since_log = time.time(), 0

if master:
    if new_log:  # an --overwrite run that saved nothing: the old pair stays, its log is dropped
        log_file.close()
        os.remove(new_log)
    kept = (f"checkpoint {ckpt_path} (iteration {saved})" if saved is not None else
            "no iteration trained, no checkpoint saved" + (f"; the old {ckpt_path} is kept" if new_log else ""))
    print(f"done: {iter_num} iterations in {time.time() - t_start:.1f}s; best val loss {best_val_loss:.4f}; {kept}")
if ddp:
    dist.barrier()  # let the master finish its last checkpoint first
    dist.destroy_process_group()
