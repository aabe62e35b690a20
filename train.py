"""
Read first. Train a GPT with full, SWA, SA, SA+SWA or MoBA attention, after nanoGPT's train.py.

One process (a CPU or one GPU), its resume after Ctrl-C or a crash, GPT-2 fine-tuned with SA+SWA
(the paper's swap, then training):
  python prepare_data.py && python train.py config/quick.py
  python train.py config/quick.py --attn=swa --window=64 --out_dir=out-swa
  python train.py config/quick.py --init_from=resume
  python train.py --init_from=gpt2 --dataset=wikitext-103 --block_size=1024 --learning_rate=3e-5 --min_lr=3e-6
DDP, on one node of 8 GPUs, or two nodes:
  torchrun --standalone --nproc_per_node=8 train.py config/paper_360m.py
  torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=IP --master_port=1234 train.py ...

Every eval appends to out_dir/log.jsonl and, after iteration 0, saves out_dir/ckpt.pt
(always_save_checkpoint; eval_only: never) with every rank's RNG states: a resume with the same
settings is bitwise the run that never stopped on the CPU (tests/test_train.py); on CUDA only with
deterministic kernels, which train.py does not ask for (SDPA's flash backward is not). A larger
max_iters trains on, the cosine still ending at lr_decay_iters. Nothing is lost (checkpoint.RunDir):
a second run into a busy out_dir is refused, a NaN or inf loss stops the run before anything of it
is saved, and a new run replaces an old checkpoint only with --overwrite=True.
"""
import math
import os
import time
from collections import Counter
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import attention
from checkpoint import RunDir, from_gpt2, load_checkpoint, restore, rng_states
from guards import check_memory, need
from model import BUILT, DTYPES, GPT, GPTConfig, autocast
from prepare_data import dataset_dir, load_data, mqar_batch, mqar_targets, task_metrics

# -----------------------------------------------------------------------------
# Defaults: a GPT-2-small-sized (124M) SA+SWA model on FineWeb-Edu, 5000 iterations of 0.5M tokens
# (2.6B); its peak (eager bf16, H200: 20.1 GiB before SA's fused kernel; gpu_check.memory_estimate
# now: 19.4) fits a 40 GB A100.
# I/O
out_dir = "out"
eval_interval = 250  # iterations between evals, and one at the end
log_interval = 10  # iterations between prints of the loss and speed
eval_iters = 50  # batches per split per eval
eval_only = False  # evaluate once and exit
always_save_checkpoint = True  # save at every eval; False: only when val loss improves
init_from = "scratch"  # "scratch", "resume" (out_dir/ckpt.pt), "gpt2" ... "gpt2-xl", or a directory
overwrite = False  # True: a new run's first checkpoint replaces out_dir's ckpt.pt
# model (GPTConfig: model.py)
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0  # residual and embedding dropout
bias = False  # biases in Linears and LayerNorms (GPT-2 has them)
attn = "sa+swa"  # the attention: full, swa, sa, sa+swa (the paper's gated SA and SWA) or moba
window = 256  # SWA's and SA's keys per query, itself included
sa_draw = "layer"  # "layer": one SA permutation per layer and forward (the paper's); "head": per head
sa_rule = "rank"  # "rank": SWA in the permuted order (the paper's); "value": a number r per token
moba_chunk = 64  # MoBA's key chunk (its paper's "block")
moba_topk = 4  # MoBA's chunks per query, its own included
pos_emb = "rope"  # "rope", or "learned" (GPT-2's, to load its weights)
rope_base = 10000.0
vocab_size = 0  # 0: the data's, padded up to a multiple of 64
# data
dataset = "fineweb-edu"  # data_root/<dataset>/ from prepare_data.py
data_root = "data"
gradient_accumulation_steps = 32  # micro-steps per iteration, the total over DDP ranks
batch_size = 8  # sequences per micro-step per rank
block_size = 2048  # tokens per sequence (mqar: the data's seq_len; a GPT-2: at most its 1024)
copy_task = False  # far copying: each sequence is a random passage of block_size/2 tokens, twice
# AdamW, warmup and cosine decay
learning_rate = 6e-4
max_iters = 5000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # the gradient norm's clip; 0: off
decay_lr = True
warmup_iters = 200
lr_decay_iters = 5000  # nanoGPT: about max_iters
min_lr = 6e-5
# system
device = "cuda" if torch.cuda.is_available() else "cpu"
# autocast: float32 | bfloat16 | float16 (with loss scaling: GPUs without bf16, a T4)
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
compile: bool | None = None  # torch.compile; None: on CUDA only (the CPU is slow to compile)
attn_engine = "auto"  # attention.ATTN_ENGINE: auto, torch, triton or dense
backend = ""  # DDP's: "" = nccl on CUDA, gloo on the CPU
seed = 1337
# a GPTConfig field not written out above (a new attention's own setting) is a setting too
globals().update({f.name: f.default for f in fields(GPTConfig) if f.name not in globals()})
# -----------------------------------------------------------------------------
exec(open("configurator.py").read())  # overrides from config files and --key=value, each checked
settings = {k: globals()[k] for k in setting_names}  # every setting, for logs and checkpoints
# -----------------------------------------------------------------------------

# setup. DDP: torchrun sets RANK. Each rank and micro-step draws its own SA permutations: N ranks x
# M micro-steps average gradients over N*M independent draws, as one process would.
ddp = "RANK" in os.environ
rank, local_rank, world_size = 0, 0, 1
if ddp:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend or ("nccl" if device.startswith("cuda") else "gloo"))
    need(gradient_accumulation_steps % world_size == 0,
         f"gradient_accumulation_steps={gradient_accumulation_steps} must be divisible by the "
         f"{world_size} ranks")
    gradient_accumulation_steps //= world_size
master = rank == 0
device_type = "cuda" if device.startswith("cuda") else "cpu"
ctx = autocast(device, dtype)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
model_args = {f.name: settings[f.name] for f in fields(GPTConfig)}
config = GPTConfig(**{**model_args, "vocab_size": vocab_size or 1})  # the settings, before any data

# data: train.bin and val.bin, sequences of T tokens
data_dir = dataset_dir(data_root, dataset)
meta, data, T = load_data(data_dir, block_size, copy_task)
reach = config.n_layer * (config.window - 1)  # how far back SWA's layers reach
if "mqar" in meta and config.attn == "swa" and reach < meta["mqar"]["min_gap"] and master:
    print(f"mqar: SWA's reach {config.n_layer} x ({config.window} - 1) < min_gap "
          f"{meta['mqar']['min_gap']}: it can only guess")


def get_batch(split, gen):
    """batch_size random sequences x, y (B, T) of split's tokens, from the torch generator gen; y is
    x shifted by one. The copy task: a passage of T/2 tokens, twice (y's last -1). MQAR: whole
    sequences, y their answers (-1 elsewhere), and fresh ones when training
    (prepare_data.mqar_batch)."""
    tokens, B = data[split], batch_size
    if "mqar" in meta and split == "train":
        rng = np.random.default_rng(torch.randint(2**62, (), generator=gen).item())
        x, y = mqar_batch(rng, B, meta)
    else:
        n = T // 2 if copy_task else T  # tokens read per sequence
        if "mqar" in meta:  # whole sequences
            ix = torch.randint(len(tokens) // T, (B,), generator=gen).numpy() * T
        else:
            ix = torch.randint(len(tokens) - n, (B,), generator=gen).numpy()
        x = np.stack([tokens[i:i + n] for i in ix]).astype(np.int64)  # (B, n)
        if "mqar" in meta:
            y = mqar_targets(x, meta)
        elif copy_task:
            x = np.concatenate([x, x], 1)  # (B, T)
            y = np.concatenate([x[:, 1:], np.full((B, 1), -1)], 1)  # (B, T)
        else:
            y = np.stack([tokens[i + 1:i + 1 + T] for i in ix]).astype(np.int64)  # (B, T)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device_type == "cuda":  # pinned, so the copy does not wait for the GPU
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    return x, y


# model init: every rank builds the same weights from `seed`, then takes its own streams for
# dropout, data and SA
model_args["vocab_size"] = vocab_size or math.ceil(meta["vocab_size"] / 64) * 64
need(model_args["vocab_size"] >= meta["vocab_size"],
     f"vocab_size={vocab_size} is smaller than the vocabulary of {data_dir} ({meta['vocab_size']}): "
     "use --vocab_size=0")
check_memory(device, config.n_layer, config.n_embd, model_args["vocab_size"], batch_size, T)
ckpt_path = os.path.join(out_dir, "ckpt.pt")
torch.manual_seed(seed)
dropout_seed, data_seed, sa_seed = np.random.SeedSequence([seed, rank]).generate_state(3).tolist()
iter_num, best_val_loss, ckpt = 0, float("inf"), None
if init_from == "scratch":
    model = GPT(GPTConfig(**model_args))
elif init_from == "resume":  # the checkpoint's model settings and tokenizer must be this run's
    model, ckpt = load_checkpoint(ckpt_path, resume=(settings, meta))
    iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
else:  # GPT-2's weights with this run's attention (its swap), to fine-tune
    override = {f.name: settings[f.name] for f in fields(GPTConfig) if f.name not in BUILT}  # attention
    model = from_gpt2(init_from, {**override, "dropout": dropout})
    model.crop_block_size(block_size)
    need(meta["vocab_size"] <= model.config.vocab_size,
         f"init_from={init_from!r} reads {model.config.vocab_size} token ids, fewer than "
         f"{data_dir}'s {meta['vocab_size']}: prepare the data with its tokenizer (gpt2)")
model.seed_sa(sa_seed)  # a resume restores the saved state, except on ranks the checkpoint lacks
model.to(device)
torch.manual_seed(dropout_seed)
data_rng = torch.Generator().manual_seed(data_seed)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if ckpt is not None:  # where the run stopped
    restore(ckpt, optimizer, scaler, data_rng, model, rank)
    need(max_iters >= iter_num or eval_only,
         f"max_iters={max_iters}: {ckpt_path} is at iteration {iter_num} already: raise max_iters "
         "to train on")
ckpt = None  # free up memory

raw_model = model  # the GPT itself: checkpoints, SA's state, MFU
compile = device_type == "cuda" if compile is None else compile
if compile:
    model = torch.compile(model)
eval_model = model  # estimate_loss's: rank 0 evaluates alone, without DDP
if ddp:  # the RoPE tables are constant: no buffers to broadcast
    device_ids = [local_rank] if device_type == "cuda" else None
    model = DDP(model, device_ids=device_ids, broadcast_buffers=False)


@torch.no_grad()
def estimate_loss():
    """Mean loss per split over eval_iters fixed batches and SA draws, and the task's measures
    (prepare_data.task_metrics). SA's generator is restored after: an eval leaves training
    unchanged."""
    out, sa_state = {}, raw_model.sa_state.clone()
    eval_model.eval()
    for split in ("train", "val"):
        gen = torch.Generator().manual_seed(seed)
        raw_model.seed_sa(seed)
        losses, sums = [], Counter()
        for _ in range(eval_iters):
            X, Y = get_batch(split, gen)
            with ctx:
                logits, loss = eval_model(X, Y)
            losses.append(loss.item())
            sums.update(task_metrics(logits, Y, meta, copy_task))
        out[f"{split}_loss"] = sum(losses) / len(losses)
        out.update({f"{split}_{k}": v / sums["n"] for k, v in sums.items() if k != "n"})
    raw_model.sa_state.copy_(sa_state)
    eval_model.train()
    return out


def get_lr(it):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def stop_if_diverged(loss, what):
    """Stop on a NaN or inf loss; under DDP on the ranks' sum, so all stop together. With fp16 an
    inf gradient is normal, an inf loss is not."""
    loss = torch.as_tensor(loss, dtype=torch.float32, device=device)
    if ddp:
        dist.all_reduce(loss)
    kept = run.holds() if master else "rank 0 says what the checkpoint holds"
    need(math.isfinite(loss.item()),
         f"iteration {iter_num}: the {what} is {loss.item()}: the run diverged (lower --learning_rate?); {kept}")


# logging: the master appends to log.jsonl each eval's losses and task measures and, every
# log_interval, the loss and speed (mfu: null off CUDA)
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * T
run = None
if master:
    run = RunDir(out_dir, iter_num if init_from == "resume" else None, best_val_loss)
    best_val_loss = run.best_val_loss  # a resume's, from log.jsonl (checkpoint.RunDir)
    print(f"{dataset}: {len(data['train']):,} train / {len(data['val']):,} val tokens; "
          f"{raw_model.get_num_params() / 1e6:.2f}M parameters, attn={raw_model.config.attn}, "
          f"window={raw_model.config.window}; {tokens_per_iter:,} tokens per iteration ({world_size} x "
          f"{gradient_accumulation_steps} x {batch_size} x {T}) on {device}")
attention.ATTN_ENGINE = attn_engine
c = raw_model.config  # the settings', or a GPT-2's (init_from=gpt2...)
line = attention.engine_line(device, DTYPES[dtype], c.n_embd // c.n_head, [c.attn], c.sa_rule)
if master:  # each rank's GPU checked itself
    print(line)

# training loop
t_start = t_last = time.time()
iters_since_log = 0
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr

    if iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only:
        states = rng_states(data_rng, raw_model, ddp)  # a collective under DDP
        ev = estimate_loss() if master else {}
        stop_if_diverged(ev.get("train_loss", 0.0) + ev.get("val_loss", 0.0), "eval's train + val loss")
        if master:
            measures = "".join(f", {k} {v:.4f}" for k, v in ev.items() if not k.endswith("_loss"))
            print(f"step {iter_num}: train loss {ev['train_loss']:.4f}, val loss {ev['val_loss']:.4f}{measures}")
            run.log({"iter": iter_num, **ev, "lr": lr, "elapsed_s": round(time.time() - t_start, 2)})
            improved = ev["val_loss"] <= best_val_loss  # than every eval before
            best_val_loss = min(best_val_loss, ev["val_loss"])
            if iter_num > 0 and not eval_only and (always_save_checkpoint or improved):
                run.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                          "scaler": scaler.state_dict(), "model_args": raw_model.model_args(),
                          "iter_num": iter_num, "best_val_loss": best_val_loss, "settings": settings,
                          "meta": meta, "rng": states})
        t_last, iters_since_log = time.time(), 0  # the speed leaves out evaluation
    if iter_num >= max_iters or eval_only:
        break

    # forward backward update, with gradient accumulation (no prefetch: a checkpoint's data RNG is
    # the next batch's)
    losses = torch.zeros((), device=device)  # summed, checked before the step
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # all-reduce gradients on the last micro-step only
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch("train", data_rng)
        with ctx:
            _, loss = model(X, Y)
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
        lossf = loss.item()  # the last micro-step's; a sync point, so the timing is honest
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = (time.time() - t_last) / iters_since_log
        mfu = None  # model FLOPs utilisation, on a GPU: its share of an A100's bf16 peak
        if device_type == "cuda":
            mfu = raw_model.estimate_mfu(tokens_per_iter // world_size, dt, T)
        shown = "" if mfu is None else f", mfu {mfu * 100:.2f}% (of an A100's bf16 peak)"
        print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {dt * 1000:.0f} ms/iter, "
              f"{tokens_per_iter / dt:,.0f} tok/s{shown}")
        run.log({"iter": iter_num, "loss": lossf, "lr": lr, "ms_per_iter": round(dt * 1000, 2),
                 "tok_per_s": round(tokens_per_iter / dt), "mfu": mfu,
                 "elapsed_s": round(time.time() - t_start, 2)})
        t_last, iters_since_log = time.time(), 0

if master:
    print(f"done: {iter_num} iterations in {time.time() - t_start:.1f}s; "
          f"best val loss {best_val_loss:.4f}; {run.close()}")
if ddp:
    dist.barrier()  # wait for the master's last checkpoint
    dist.destroy_process_group()
