"""
The prepared GPU check: one command for a CUDA machine, at most about 8 minutes on an H100-class GPU
(the stages' time limits: 100 + 150 + 2 x 110 s). Without a GPU it stops at once with one line.

    python results/gpu_check.py                          # writes results/gpu_check.json
    python results/gpu_check.py --train_iters=20 --out=/tmp/check.json

It runs four stages, each under its own time limit, so that a failing or timed-out stage is recorded with its
output and the next one still runs: the kernel's self-check and a training micro-step's memory beside
memory_estimate, in this process; kernel.py --check; bench.py's speed table on the GPU; and short train.py runs
of the full and the SA+SWA model, compiled as train.py is on CUDA, for tok/s, MFU and the graph breaks Dynamo
logs (TORCH_LOGS=graph_breaks). The results file names the GPU, torch and Triton, and sets
our full/SA speed ratios beside the paper's A100 ones (1.5x at 2k, 6.6x at 8k, 28x at 32k tokens; the paper
does not say whether they are forward or training).
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
check_timeout = 100              # seconds for stage 1
bench_timeout = 150              # seconds for stage 2
train_timeout = 110              # seconds for each run of stage 3
sizes = "2048,8192,32768"        # stage 2: sequence lengths
bench_args = "--batch=4 --heads=12 --head_dim=64 --window=256 --reps=10"  # stage 2: more bench.py settings
train_iters = 50                 # stage 3: iterations per run
# stage 3: 65k tokens per iteration, compiled as train.py is on CUDA (by hand on an H200: 40 iterations in 43 s)
train_args = "--batch_size=8 --block_size=2048 --gradient_accumulation_steps=4"
# -----------------------------------------------------------------------------
PAPER_FULL_OVER_SA = {2048: 1.5, 8192: 6.6, 32768: 28.0}  # the paper's A100 speed-ups of SA over full attention
BF16_PEAK = {"A100": 312e12, "H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s (SXM); MFU against the GPU's own


def memory_estimate(n_params, n_layer, n_embd, vocab_size, batch_size, T):
    """Peak bytes of one eager bf16-autocast training micro-step of train.py's SA+SWA GPT through the kernel:
    (states, saved activations, the loss's transient at the start of the backward). Per token-channel and
    layer the forward saves about 54 bytes (tests/test_gpu_check.py measures it on the CPU)."""
    btc, btv = batch_size * T * n_embd, batch_size * T * vocab_size
    states = 16 * n_params  # fp32 weights and gradients, AdamW's two moments
    saved = 2 * n_params + (54 * n_layer + 7) * btc + 4 * btv  # autocast's bf16 weights; the fp32 log-softmax
    return states, saved, 10 * btv  # the loss: the bf16 logits, and the log-softmax's fp32 gradient in and out


def self_check_and_memory_stage(batch_size=8, T=2048):
    """The kernel's self-check lines (train.py's default model: head dim 64, SA+SWA, both SA rules), then one
    micro-step of that model at batch_size x T in bf16, its measured peak beside memory_estimate's."""
    import attention
    from model import GPT, GPTConfig
    start = time.time()
    lines = [attention.impl_line("cuda", dtype, 64, ["sa+swa"], rule) for dtype in (torch.bfloat16, torch.float32)
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
    """`python kernel.py --check`: the Triton kernel against its own dense fp32 rule (kernel.dense), every variant at
    lengths no multiple of a tile (T = 1000, 4099) and windows 1, 64, 300; a time-out after its "all checks PASS" line still passes."""
    record = run([sys.executable, "kernel.py", "--check"], check_timeout)
    if record["status"] == "timeout" and "all checks PASS" in record["output"]:
        record["status"] = "pass"  # every check finished; only the exit was cut off
    return record


def bench_stage(device="cuda", extra=()):
    """bench.py's table (in __main__: bf16, SDPA's "full", the kernel's SWA and SA and the fair FlexAttention
    peers, forward and forward+backward), as rows read from its printed lines, so that a run cut off by the time
    limit keeps the rows it measured; and full/sa, full/flex-sa per mode and T beside the paper's full/sa."""
    record = run([sys.executable, "results/bench.py", f"--device={device}", f"--sizes={sizes}", *bench_args.split(),
                  *extra], bench_timeout)
    rows = [dict(mode=m[1], T=int(m[2]), kind=m[3], ms=float(m[4]), peak_mib=float(m[5])) for m in
            re.finditer(r"^ *(fwd|fwd\+bwd) +(\d+) +(\S+) +([\d.]+) +(\d+)", record["output"], re.M)]
    ms = {(r["mode"], r["T"], r["kind"]): r["ms"] for r in rows}
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
    out = os.path.abspath(out)
    os.chdir(ROOT)  # kernel.py, results/bench.py and train.py run from the repo root
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU, and torch sees none here (the CPU checks: python -m pytest -q)")
    import triton
    gpu = torch.cuda.get_device_name()
    result = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                  started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), stages={})

    def save(name, record):
        result["stages"][name] = record
        print(f"{name}: {record['status']} in {record['seconds']} s", flush=True)
        with open(out + ".tmp", "w") as f:  # after every stage, so that a killed run keeps what it measured
            json.dump(result, f, indent=1)
        os.replace(out + ".tmp", out)

    print(f"gpu_check on {gpu}: torch {torch.__version__}, Triton {triton.__version__}", flush=True)
    try:  # in this process: a failure is recorded, and the stages after it still run
        stage = self_check_and_memory_stage()
    except Exception as e:
        stage = dict(cmd="in process", status="fail", seconds=0, output=f"{type(e).__name__}: {e}")
    save("self-check and memory", stage)
    print(result["stages"]["self-check and memory"]["output"])
    save("kernel", kernel_stage())
    speed = bench_stage(extra=["--dtype=bfloat16", "--attn_impl=triton", "--kinds=full,swa,sa,flex-swa,flex-sa"])
    save("speed", speed)
    print(speed["output"][-3000:])
    for attn in ("full", "sa+swa"):
        save(f"train {attn}", train_stage(attn, gpu))
    for r in speed["full_over"]:
        print(f"full/{r['kind']:<7} {r['mode']:>7} T={r['T']:<6} {r['ratio']:6.2f}x   (paper, A100: {r['paper_sa']}x)")
    for attn in ("full", "sa+swa"):
        r = result["stages"][f"train {attn}"]
        print(f"train {attn:<6}: {r.get('tok_per_s', 0):,.0f} tok/s, MFU {r.get('mfu')}, graph breaks "
              f"{r['graph_breaks']} ({r['status']})")
    print(f"wrote {out}")
