"""
The prepared GPU check: one command for a CUDA machine, at most about 9 minutes on an H100-class GPU (the time limits:
40 + 75 + 110 + 4 x 70 s, besides the self-checks; less where a stage ends early). Without a GPU it stops at once with
one line. --base adds a second speed stage (110 s): run it with --stages=speed.

    python results/gpu_check.py                          # writes results/gpu_check.json
    python results/gpu_check.py --stages=speed,train --out=/tmp/check.json
    git archive c166d96 --prefix=.base/ | tar -x         # a change's base, in the tree that a GPU machine gets
    python results/gpu_check.py --stages=speed --base=.base  # also times the base's attention by the same bench.py

Its stages, each under its own time limit, so that a failing or timed-out stage is recorded with its output and the
next one still runs:
- "self-check and memory": the kernel's self-checks and a training micro-step's memory beside memory_estimate;
- "kernel": kernel.py --check at one length no multiple of a tile;
- "sweep": each candidate tiling (TILINGS) of the kernel timed on SWA and SA, forward and fwd+bwd, at sweep_T: the
  figures that choose a tiling for this GPU; then a profiler table of SA's fwd+bwd with the tiling in use;
- "speed": bench.py's table, wall and device times (--base: the base's too, by the same bench.py);
- "train": train.py's GPT-2 small, full and SA+SWA, compiled as train.py is on CUDA, at block_size 2048 and 8192 with
  the same tokens per iteration: tok/s, MFU and the graph breaks Dynamo logs (TORCH_LOGS=graph_breaks).
The results file names the GPU, torch, Triton, the commit and the command, and sets our full/SA speed ratios beside the
paper's A100 ones (1.5x at 2k, 6.6x at 8k, 28x at 32k tokens; the paper does not say whether forward or training).
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo's modules

# -----------------------------------------------------------------------------
out = "results/gpu_check.json"   # the one results file
stages = "self-check,kernel,sweep,speed,train"  # which stages run, in this order
base = ""                        # another checkout (e.g. `git worktree add ../base <commit>`): its speed stage too
check_timeout = 40               # seconds for kernel.py --check
sweep_timeout = 75               # seconds the sweep may take (it stops between tilings)
bench_timeout = 110              # seconds for each speed stage
train_timeout = 70               # seconds for each training run
sizes = "2048,8192,32768"        # speed: sequence lengths
bench_args = "--batch=4 --heads=12 --head_dim=64 --window=256 --reps=10"  # speed: more bench.py settings
sweep_T = 8192                   # sweep: the sequence length (batch 4, 12 heads of 64, window 256, bf16)
train_iters = 20                 # train: iterations per run (the first logged speed, with the compile, is dropped)
# train: 65,536 tokens per iteration at each length, compiled as train.py is on CUDA (by hand on an H200: 40
# iterations in 43 s at 2048)
train_runs = "2048:8,8192:2"     # block_size:batch_size pairs
train_args = "--gradient_accumulation_steps=4"
# -----------------------------------------------------------------------------
PAPER_FULL_OVER_SA = {2048: 1.5, 8192: 6.6, 32768: 28.0}  # the paper's A100 speed-ups of SA over full attention
BF16_PEAK = {"A100": 312e12, "H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s (SXM); MFU against the GPU's own
# the sweep's candidates (tile_m, tile_n, tile_fixed, tile_loop, num_warps, num_stages) for bf16 at head dim 64: the
# tiling in use (choose_tiling's, first), the Triton tutorial's Hopper-like ones, and smaller ones
TILINGS = [(128, 64, 128, 32, 8, 3), (128, 64, 128, 32, 4, 3), (128, 128, 128, 64, 8, 3), (128, 64, 64, 64, 4, 3),
           (128, 32, 64, 32, 4, 4), (64, 64, 64, 32, 4, 3), (64, 32, 64, 16, 4, 2), (128, 64, 128, 32, 8, 4)]


def memory_estimate(n_params, n_layer, n_embd, vocab_size, batch_size, T):
    """Peak bytes of one eager bf16-autocast training micro-step of train.py's SA+SWA GPT through the kernel:
    (states, saved activations, the loss's transient at the start of the backward). Per token-channel and
    layer the forward saves about 46 bytes (tests/test_gpu_check.py measures it on the CPU; 54 before SA's kernel read
    q, k, v through its permutation, with no gathered copies)."""
    btc, btv = batch_size * T * n_embd, batch_size * T * vocab_size
    states = 16 * n_params  # fp32 weights and gradients, AdamW's two moments
    saved = 2 * n_params + (46 * n_layer + 7) * btc + 4 * btv  # autocast's bf16 weights; the fp32 log-softmax
    return states, saved, 10 * btv  # the loss: the bf16 logits, and the log-softmax's fp32 gradient in and out


def self_check_and_memory_stage(batch_size=8, T=2048):
    """The kernel's self-check lines (train.py's default model: head dim 64, SA+SWA, both SA rules), then one
    micro-step of that model at batch_size x T in bf16, its measured peak beside memory_estimate's."""
    import attention
    from model import GPT, GPTConfig
    start = time.time()
    lines = [attention.engine_line("cuda", dtype, 64, ["sa+swa"], rule) for dtype in (torch.bfloat16, torch.float32)
             for rule in ("rank", "value")]
    model = GPT(GPTConfig(block_size=T)).cuda()
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    try:
        for step in range(2):  # the second micro-step is the steady state: AdamW's moments exist
            torch.cuda.reset_peak_memory_stats()
            x = torch.randint(model.config.vocab_size, (batch_size, T + 1), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        measured = torch.cuda.max_memory_allocated()
    except torch.cuda.OutOfMemoryError as e:
        measured = str(e).splitlines()[0]
    c, n_params = model.config, sum(p.numel() for p in model.parameters())
    parts = memory_estimate(n_params, c.n_layer, c.n_embd, c.vocab_size, batch_size, T)
    peak = measured if isinstance(measured, str) else f"{measured / 2**30:.1f} GiB"
    lines.append(f"memory, a micro-step of batch {batch_size} x {T}: measured {peak}; estimated "
                 "{:.1f} GiB (states {:.1f}, saved activations {:.1f}, loss {:.1f})".format(sum(parts) / 2**30,
                                                                                     *(b / 2**30 for b in parts)))
    return dict(cmd="in process", status="pass" if all("passed" in s for s in lines[:4]) else "fail",
                seconds=round(time.time() - start, 1), output="\n".join(lines),
                memory=dict(batch_size=batch_size, T=T, measured=measured, estimate=sum(parts), estimate_parts=parts))


def graph_breaks(output):
    """The graph breaks that TORCH_LOGS=graph_breaks reported in output."""
    return output.count("[__graph_breaks] Graph break")


def run(cmd, timeout):
    """A stage's record: status (pass, fail or timeout), seconds, the graph breaks Dynamo logged, and the tails of
    its stdout and stderr (where those logs go)."""
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,  # a timed-out stage keeps its output
                           env={**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "graph_breaks"})
        status, out, err = ("pass" if p.returncode == 0 else "fail"), p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        status = "timeout"
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
    return dict(cmd=" ".join(cmd), status=status, seconds=round(time.time() - start, 1),
                graph_breaks=graph_breaks(out + err), output=out[-6000:] + err[-3000:])


def kernel_stage():
    """`python kernel.py --check`: the Triton kernel against its own dense fp32 rule (kernel.dense), every rule (SA's
    with one permutation for all heads and one per head) at T = 4099, no multiple of a tile, windows 64 and 300; a
    time-out after its "all checks PASS" line still passes."""
    record = run([sys.executable, "kernel.py", "--check", "--check_T=4099", "--check_windows=64,300"], check_timeout)
    if record["status"] == "timeout" and "all checks PASS" in record["output"]:
        record["status"] = "pass"  # every check finished; only the exit was cut off
    return record


def sweep_stage(B=4, H=12, D=64, window=256, dtype=torch.bfloat16, device="cuda"):
    """Each of TILINGS timed on the kernel's SWA and SA (rank rule), forward and fwd+bwd, at sweep_T, with its
    largest difference from the tiling in use (a wrong tiling shows); until sweep_timeout. Then a profiler table of
    SA's fwd+bwd with the tiling in use: the kernels and the ops around them."""
    import attention
    import kernel
    from bench import device_ms
    from torch.profiler import ProfilerActivity, profile
    start, T, rows, engine = time.time(), sweep_T, [], attention.ENGINE
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    perm = torch.randperm(T, device=device, generator=g)
    calls = {"swa": lambda: attention.sliding_window_attention(q, k, v, window),
             "sa": lambda: attention.stochastic_attention(q, k, v, window, perm)}
    dout = dout.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T, D) laid out (B, T, H, D), as training's
    default, choose = kernel.choose_tiling(dtype, D, kernel.device_target(q.device)), kernel.choose_tiling
    try:
        attention.ENGINE = "triton"
        want = {kind: call().float() for kind, call in calls.items()}
        for tiling in TILINGS:
            if time.time() - start > sweep_timeout:
                break
            kernel.choose_tiling = lambda *_, t=tiling: default._replace(**dict(zip(default._fields, t)))
            row = dict(tiling=tiling)
            try:
                for kind, call in calls.items():
                    with torch.no_grad():
                        row[f"{kind} diff"] = float((call().float() - want[kind]).abs().max())
                        row[f"{kind} fwd ms"] = round(device_ms(call), 4)
                    grads = lambda: torch.autograd.grad(call(), (q, k, v), dout)  # noqa: E731
                    row[f"{kind} fwd+bwd ms"] = round(device_ms(grads), 4)
            except Exception as e:  # e.g. out of shared memory: the row says so
                row["error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
            rows.append(row)
            print(row, flush=True)
        kernel.choose_tiling, cuda = choose, q.is_cuda
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            for _ in range(5):
                torch.autograd.grad(calls["sa"](), (q, k, v), dout)
            if cuda:
                torch.cuda.synchronize()
    finally:
        kernel.choose_tiling, attention.ENGINE = choose, engine
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=15)
    return dict(cmd="in process", status="pass" if rows and "error" not in rows[0] else "fail",
                seconds=round(time.time() - start, 1), T=T, rows=rows, output=table)


def bench_stage(device="cuda", extra=()):
    """bench.py's table (in __main__: bf16, SDPA's "full", the kernel's SWA and SA and the fair FlexAttention
    peers, forward and forward+backward), as rows read from its printed lines, so that a run cut off by the time
    limit keeps the rows it measured; and full/sa, full/flex-sa per mode and T beside the paper's full/sa, by device
    time where there is one."""
    record = run([sys.executable, "results/bench.py", f"--device={device}", f"--sizes={sizes}", *bench_args.split(),
                  *extra], bench_timeout)
    rows = [dict(mode=m[1], T=int(m[2]), kind=m[3], ms=float(m[4]), device_ms=None if m[5] == "-" else float(m[5]),
                 peak_mib=float(m[6])) for m in
            re.finditer(r"^ *(fwd|fwd\+bwd) +(\d+) +(\S+) +([\d.]+) +([\d.]+|-) +(\d+)", record["output"], re.M)]
    ms = {(r["mode"], r["T"], r["kind"]): r["device_ms"] or r["ms"] for r in rows}
    record["rows"] = rows
    record["full_over"] = [dict(mode=m, T=T, kind=kind, ratio=round(ms[m, T, "full"] / t, 2),
                                paper_sa=PAPER_FULL_OVER_SA.get(T))
                           for (m, T, kind), t in ms.items() if kind in ("sa", "flex-sa") and (m, T, "full") in ms]
    return record


def random_tokens(data_dir, vocab=50257, n=2**22):
    """A dataset of uniformly random GPT-2 token ids in prepare_data.py's format (meta.json, train.bin,
    val.bin): a speed test needs no real text."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(vocab, size=n, dtype=np.uint16).tofile(os.path.join(data_dir, f"{split}.bin"))
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(dict(vocab_size=vocab, tokenizer="gpt2", dtype="uint16", tokens=dict(train=n, val=n)), f)


def train_stage(attn, gpu, iters=None, extra=()):
    """train.py's default model (GPT-2 small, 124M) for iters iterations with this attention, on random tokens
    written to a temporary folder (no download): tok/s and MFU, the median of its logged speeds after the
    first (none if it logged only one)."""
    iters = iters or train_iters
    with tempfile.TemporaryDirectory() as tmp:
        random_tokens(os.path.join(tmp, "random"))
        record = run([sys.executable, "train.py", f"--data_root={tmp}", "--dataset=random", f"--attn={attn}",
                      f"--out_dir={tmp}/out", f"--max_iters={iters}", f"--lr_decay_iters={iters}",
                      f"--eval_interval={iters}", "--eval_iters=1", f"--log_interval={max(1, iters // 5)}",
                      *train_args.split(), *extra],
                     train_timeout)
        log = os.path.join(tmp, "out", "log.jsonl")
        speeds = [r for r in map(json.loads, open(log)) if "tok_per_s" in r] if os.path.exists(log) else []
    speeds = speeds[1:]  # the first holds the warm-up and the compile
    if speeds:
        record["tok_per_s"] = statistics.median(r["tok_per_s"] for r in speeds)
        mfu = [r["mfu"] for r in speeds if r["mfu"] is not None]
        record["mfu_of_a100_peak"] = statistics.median(mfu) if mfu else None  # as train.py prints it
        peak = next((p for name, p in BF16_PEAK.items() if name in gpu), None)
        record["mfu"] = record["mfu_of_a100_peak"] * BF16_PEAK["A100"] / peak if mfu and peak else None
    return record


if __name__ == "__main__":
    exec(open(os.path.join(ROOT, "configurator.py")).read())
    from guards import need
    from provenance import provenance
    out, base = os.path.abspath(out), base and os.path.abspath(base)
    os.chdir(ROOT)  # kernel.py, results/bench.py and train.py run from the repo root
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU, and torch sees none here (the CPU checks: python -m pytest -q)")
    import triton
    gpu = torch.cuda.get_device_name()
    result = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                  started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), stages={})

    def save(name, record):
        result["stages"][name] = dict(record, **provenance())  # each stage: this commit and command
        print(f"{name}: {record['status']} in {record['seconds']} s", flush=True)
        with open(out + ".tmp", "w") as f:  # after every stage, so that a killed run keeps what it measured
            json.dump(result, f, indent=1)
        os.replace(out + ".tmp", out)

    def in_process(stage):  # a failure is recorded, and the stages after it still run
        try:
            return stage()
        except Exception as e:
            return dict(cmd="in process", status="fail", seconds=0, output=f"{type(e).__name__}: {e}")

    print(f"gpu_check on {gpu}: torch {torch.__version__}, Triton {triton.__version__}", flush=True)
    todo = stages.split(",")
    need(set(todo) <= {"self-check", "kernel", "sweep", "speed", "train"}, f"stages={stages!r}: use some of "
         "self-check,kernel,sweep,speed,train")
    need(not base or os.path.isfile(os.path.join(base, "attention.py")), f"base={base!r} holds no attention.py")
    if "self-check" in todo:
        save("self-check and memory", in_process(self_check_and_memory_stage))
        print(result["stages"]["self-check and memory"]["output"])
    if "kernel" in todo:
        save("kernel", kernel_stage())
    if "sweep" in todo:
        save("sweep", in_process(sweep_stage))
        print(result["stages"]["sweep"]["output"])
    kinds = ["--dtype=bfloat16", "--attn_engine=triton", "--kinds=full,swa,sa,flex-swa,flex-sa"]
    for name, where in [("speed", [])] + [("speed of the base", [f"--modules={base}"])] * bool(base):
        if "speed" in todo:
            save(name, bench_stage(extra=kinds + where))
            print(result["stages"][name]["output"][-3000:])
    for pair in train_runs.split(",") if "train" in todo else ():
        T, batch = pair.split(":")
        for attn in ("full", "sa+swa"):
            save(f"train {attn} T={T}", train_stage(attn, gpu, extra=[f"--block_size={T}", f"--batch_size={batch}"]))
    for name in ("speed", "speed of the base"):
        for r in result["stages"].get(name, {}).get("full_over", []):
            print(f"{name}: full/{r['kind']:<7} {r['mode']:>7} T={r['T']:<6} {r['ratio']:6.2f}x   (paper, A100: "
                  f"{r['paper_sa']}x)")
    for name, r in result["stages"].items():
        if name.startswith("train"):
            print(f"{name:<20}: {r.get('tok_per_s', 0):,.0f} tok/s, MFU {r.get('mfu')}, graph breaks "
                  f"{r['graph_breaks']} ({r['status']})")
    print(f"wrote {out}")
