"""
The prepared GPU check: one command for a CUDA machine that fits its window, the base's A/B included: every stage has
a time limit, cut to what is left of --budget (420 s, 7 minutes; the machine's start aside), and a running total is
printed after each. Without a GPU it stops at once with one line.

    git archive 13a6b5a --prefix=.base/ | tar -x         # where the clone is: a change's base, in the tree the GPU gets
    python results/gpu_check.py --base=.base --commit=1a2b3c4   # 1a2b3c4: `git rev-parse --short HEAD` there

The GPU machine's copy of the tree has no .git: --commit names the commit that every record carries. The results go to
$OUT/gpu_check.json where OUT is set (the folder a GPU machine sends back), else to results/gpu_check.json, or to
--out; a run is appended to the file's runs, never written over an earlier one.

Its stages, in this order, each in a process of its own that is killed at its limit (its record keeps what it
measured by then), so that the next one still runs:
- "compile" (40 s): every Triton kernel the stages after it run, compiled up front by 16 processes at once, into
  Triton's cache, where those stages find them (kernel.py --check compiled 26 one by one in 62 s);
- "self-check" (25 s): kernel.self_check of every rule in bf16 and fp32 at head dim 64, each timed, as at a training
  run's first call; then a training micro-step's peak memory beside memory_estimate's;
- "kernel" (15 s): kernel.py --check at T = 4099, the specialisation of a T no multiple of 16 (training's is the
  self-check's), window 300, bf16;
- "sweep" (40 s): each of CANDIDATES (tilings and kernel variants) timed on SWA and both SA rules, forward and
  backward, at each of sweep_sizes, with its largest difference from today's tiling in out and gradients (a wrong
  candidate shows): the figures that choose a tiling per GPU and length (kernel.TUNED); a profiler table of SA;
- "speed" (90 s): bench.py's table, wall and device times: full (SDPA), the kernel's SWA, SA with one permutation and
  with one per head, SA's value rule, and the fair FlexAttention peers, forward and fwd+bwd; with --base, the base's
  kinds too, alternately with this tree's in one process, 3 rounds each;
- "train" (50 s a run): train.py's GPT-2 small, full and SA+SWA, compiled as train.py is on CUDA, at block_size 2048
  and 8192 with the same tokens per iteration: tok/s and MFU of the first timed iterations, after which the run is
  stopped (no checkpoint is written), and the graph breaks Dynamo logs (TORCH_LOGS=graph_breaks).
The results set our full/SA speed ratios beside the paper's A100 ones (1.5x at 2k, 6.6x at 8k, 28x at 32k tokens; the
paper does not say whether forward or training).
"""
import concurrent.futures
import json
import multiprocessing
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

START = time.time()  # the budget counts from here: importing torch takes seconds
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo's modules

# -----------------------------------------------------------------------------
out = ""                         # the results file; "": $OUT/gpu_check.json where OUT is set, else in results/
stages = "compile,self-check,kernel,sweep,speed,train"  # which stages run, in this order
base = ""                        # a change's base checkout (git archive, as above): its speed too, alternately
commit = ""                      # the commit the tree holds, for a copy without .git (the GPU machine's)
budget = 420                     # seconds for the whole run; each stage's limit is cut to what is left
limits = "compile:40,self-check:25,kernel:15,sweep:40,speed:90,train:50"  # seconds per stage (train: per run)
device = "cuda" if torch.cuda.is_available() else "cpu"  # where the stages run (the CPU: only a stage's tests)
check_T, check_windows, check_dtypes, check_heads = "4099", "300", "bfloat16", 16  # kernel: kernel.py --check's
sizes = "2048,8192,32768"        # speed: sequence lengths
bench_args = "--batch=4 --heads=12 --head_dim=64 --window=256 --reps=10 --rounds=3"  # speed: more bench.py settings
bench_kinds = "full,swa,sa,sa-bht,sa-value,flex-swa,flex-sa"
sweep_sizes = "2048,8192"        # sweep: sequence lengths
sweep_shape = "4,12,64,256"      # sweep: batch, heads, head dim, window (bf16; the CPU's interpreter: fp32)
candidates = ""                  # sweep: which of CANDIDATES, by index ("0,5"); "": all
sweep_reps = 10                  # sweep: timed calls per measurement
train_runs = "2048:8,8192:2"     # train: block_size:batch_size pairs, 65,536 tokens per iteration each
train_args = "--gradient_accumulation_steps=4"
train_iters = 5                  # train: timed iterations per run, after the first (which holds the compile)
child = ""                       # internal: "stage:path", the stage a child process runs and where its record goes
# -----------------------------------------------------------------------------
STAGES = ("compile", "self-check", "kernel", "sweep", "speed", "train")
PAPER_FULL_OVER_SA = {2048: 1.5, 8192: 6.6, 32768: 28.0}  # the paper's A100 speed-ups of SA over full attention
BF16_PEAK = {"A100": 312e12, "H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s (SXM); MFU against the GPU's own
# The sweep's candidates for bf16 at head dim 64, each a kernel.Tiling's fields over choose_tiling's (128, 64, 128, 32,
# 8 warps, 3 stages), today's first. Each compiles without spills for sm_80 to sm_90, those in SM90_ONLY for sm_90
# alone (tests/test_kernel.py), where they are swept.
CANDIDATES = [
    {},
    dict(one_loop=True),  # one pipelined, masked loop per direction, not three runs
    dict(tile_m=64, num_warps=4, bwd_warps=8),  # 64-row query tiles with 4 warps: occupancy
    dict(tile_m=64, num_warps=4, bwd_warps=8, one_loop=True),
    dict(tile_n=128, one_loop=True),  # 128 keys per step
    dict(dq_atomic=True),  # FlashAttention-2's backward: 5 dots, dQ by atomics
    dict(dq_atomic=True, one_loop=True),
    dict(dq_atomic=True, tile_loop=64, one_loop=True),  # FA2's backward with 128 x 64 tiles
    dict(spans_first=True),  # the value rule's key spans by a launch of their own
]
SM90_ONLY = (4, 7)
SWEEP_KINDS = ("swa", "sa", "sa-value")


def memory_estimate(n_params, n_layer, n_embd, vocab_size, batch_size, T):
    """Peak bytes of one eager bf16-autocast training micro-step of train.py's SA+SWA GPT through the kernel:
    (states, saved activations, the loss's transient at the start of the backward). Per token-channel and
    layer the forward saves about 46 bytes (tests/test_gpu_check.py measures it on the CPU; 54 before SA's kernel read
    q, k, v through its permutation, with no gathered copies)."""
    btc, btv = batch_size * T * n_embd, batch_size * T * vocab_size
    states = 16 * n_params  # fp32 weights and gradients, AdamW's two moments
    saved = 2 * n_params + (46 * n_layer + 7) * btc + 4 * btv  # autocast's bf16 weights; the fp32 log-softmax
    return states, saved, 10 * btv  # the loss: the bf16 logits, and the log-softmax's fp32 gradient in and out


def graph_breaks(output):
    """The graph breaks that TORCH_LOGS=graph_breaks reported in output."""
    return output.count("[__graph_breaks] Graph break")


def run(cmd, limit, stop=None):
    """A stage's record: status (pass, fail or timeout), seconds, the graph breaks Dynamo logged, and the tails of
    its stdout and stderr (where those logs go). The command and every process it starts are killed at the limit, or
    once stop() (asked every half second) is true: a pass."""
    start, status = time.time(), None
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        p = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "graph_breaks"})
        while status is None:
            try:
                status = "pass" if p.wait(0.5) == 0 else "fail"
            except subprocess.TimeoutExpired:
                status = "pass" if stop and stop() else "timeout" if time.time() - start > limit else None
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its process group: a compile's workers too
            p.wait()
        stdout.seek(0), stderr.seek(0)
        o, e = stdout.read(), stderr.read()
    return dict(cmd=shlex.join(cmd), status=status, seconds=round(time.time() - start, 1),
                graph_breaks=graph_breaks(o + e), output=o[-6000:] + e[-3000:])


def in_child(stage, limit, settings):
    """run() of this script with these settings on one in-process stage, in a child process: the child writes its
    record (after every step, so that a stage cut off by its limit keeps what it measured), which is returned, this
    run's status on it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "record.json")
        record = run([sys.executable, os.path.abspath(__file__), *settings, f"--child={stage}:{path}"], limit)
        try:
            with open(path) as f:
                got = json.load(f)
        except (OSError, ValueError):
            got = {}
    status = got.get("status", "fail") if record["status"] == "pass" else record["status"]
    return {**record, **got, "cmd": f"in a child: {stage}", "log": record["output"], "status": status,
            "seconds": record["seconds"]}


def writer(path):
    """A function that writes a record to path whole (by a rename), or does nothing without a path."""
    def write(record):
        if path:
            with open(path + ".tmp", "w") as f:
                json.dump(record, f, indent=1, default=str)
            os.replace(path + ".tmp", path)
    return write


# The stages

def compile_jobs():
    """The kernel calls that the stages after "compile" make, as warm-up jobs for compile_stage: (checkout, what,
    args). A job runs them at tiny sizes that Triton specialises as the stages' (T's divisibility by 16)."""
    import kernel
    jobs = [(ROOT, "self-check", (dtype, rule)) for dtype in ("bfloat16", "float32") for rule in kernel.RULES]
    jobs += [(ROOT, "kernel", (dtype, rule, int(T), int(window))) for dtype in check_dtypes.split(",")
             for T in check_T.split(",") for window in check_windows.split(",") for rule in kernel.RULES]
    classes = {int(T) % 16 == 0: int(T) for T in sweep_sizes.split(",")}.values()  # one T per specialisation
    _, _, D, window = map(int, sweep_shape.split(","))
    jobs += [(ROOT, "sweep", (i, T, kind, D, window)) for i in swept() if CANDIDATES[i] for T in classes
             for kind in SWEEP_KINDS]
    jobs += [(base, "base", (kind,)) for kind in ("swa", "sa", "sa-value")] * bool(base)
    return jobs


def warm(job):
    """One compile job, in a fresh process (this module's settings at their defaults: a job carries its own): its
    kernel calls, once (their outputs are not looked at). The kernel's own errors are the later stage's to report:
    here a line."""
    root, what, args = job
    sys.path.insert(0, root)
    import kernel
    dev = torch.device(device)
    try:
        if what == "self-check":
            kernel.self_check(dev, getattr(torch, args[0]), 64, args[1])
        elif what == "kernel":
            kernel.self_check(dev, getattr(torch, args[0]), 64, args[1], args[2], args[3], B=1, H=2)
        elif what == "sweep":
            i, T, kind, D, window = args
            tiling = kernel.choose_tiling(sweep_dtype(), D, kernel.device_target(dev))._replace(**CANDIDATES[i])
            sweep_case(tiling, kind, T, 1, 2, D, window, sweep_dtype())
        else:  # the base's attention.py, as bench.py calls it (its kernel may specialise on the heads and window)
            import attention
            setattr(attention, "ATTN_ENGINE" if hasattr(attention, "ATTN_ENGINE") else "ENGINE", "triton")
            q, k, v = (torch.randn(1, 12, 2048, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            perm, r = torch.randperm(2048, device=dev), torch.rand(2048, device=dev)
            out = {"swa": lambda: attention.sliding_window_attention(q, k, v, 256),
                   "sa": lambda: attention.stochastic_attention(q, k, v, 256, perm),
                   "sa-value": lambda: attention.stochastic_value_attention(q, k, v, 256 / 2048, r)}[args[0]]()
            out.sum().backward()
        return "pass"
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def compile_stage(progress=writer(""), workers=16):
    """compile_jobs, `workers` at a time, each in a fresh process (Triton's compiles hold one core each, and the base's
    modules must not meet this tree's)."""
    start, jobs, done = time.time(), compile_jobs(), {}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context,
                                                max_tasks_per_child=1) as pool:
        futures = {pool.submit(warm, job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            root, what, args = futures[future]
            done[f"{what} {' '.join(map(str, args))}" + " (base)" * (root != ROOT)] = future.result()
            progress(dict(status="running", jobs=done))
    failed = {job: why for job, why in done.items() if why != "pass"}
    return dict(status="pass" if not failed else "fail", seconds=round(time.time() - start, 1), jobs=done,
                output=f"{len(done) - len(failed)} of {len(jobs)} jobs compiled and ran" + "".join(
                    f"\n{job}: {why}" for job, why in failed.items()))


def self_check_stage(progress=writer(""), D=64, dtypes=(torch.bfloat16, torch.float32), batch_size=8, T=2048):
    """The kernel's self-check of every rule in each dtype at head dim D, as a call's first use runs it (check_once),
    each timed (its compiles come from the compile stage); then, on a GPU, one micro-step of train.py's default model
    (head dim 64, SA+SWA) at batch_size x T in bf16, its measured peak beside memory_estimate's."""
    import attention
    import kernel
    start, lines, dev, record = time.time(), [], torch.device(device), dict(status="running")
    for dtype in dtypes:
        for rule in kernel.RULES:
            t0 = time.time()
            try:
                kernel.check_once(dev, dtype, D, rule, attention.VALUE_MARGIN)
                err = f"max err {kernel.SELF_CHECKS[dev, dtype, D, rule]:.1e}"
            except kernel.Unsupported as e:
                err = f"FAILED: {e}"
            lines.append(f"self-check {rule:>8} {str(dtype)[6:]:>8} head dim {D}: {err} in {time.time() - t0:.2f} s")
            progress(dict(record, output="\n".join(lines)))
    record.update(status="pass" if all("FAILED" not in s for s in lines) else "fail")
    if dev.type == "cuda":
        record["memory"] = micro_step_memory(batch_size, T)
        lines.append(record["memory"].pop("line"))
    return dict(record, seconds=round(time.time() - start, 1), output="\n".join(lines))


def micro_step_memory(batch_size, T):
    """The peak of train.py's default model's second micro-step (AdamW's moments exist), bf16, beside the estimate."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(block_size=T)).cuda()
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    try:
        for step in range(2):
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
    line = (f"memory, a micro-step of batch {batch_size} x {T}: measured {peak}; estimated "
            "{:.1f} GiB (states {:.1f}, saved activations {:.1f}, loss {:.1f})".format(sum(parts) / 2**30,
                                                                                 *(b / 2**30 for b in parts)))
    return dict(batch_size=batch_size, T=T, measured=measured, estimate=sum(parts), estimate_parts=parts, line=line)


def kernel_stage(limit):
    """`python kernel.py --check` at check_T, check_windows, check_dtypes: the Triton kernel against its own dense
    fp32 rule (kernel.dense), every rule, SA's with one permutation for all heads and one per head; a time-out after
    its "all checks PASS" line still passes."""
    record = run([sys.executable, "kernel.py", "--check", f"--check_T={check_T}", f"--check_windows={check_windows}",
                  f"--dtypes={check_dtypes}", f"--H={check_heads}"], limit)
    if record["status"] == "timeout" and "all checks PASS" in record["output"]:
        record["status"] = "pass"  # every check finished; only the exit was cut off
    return record


def swept():
    """The indices of the CANDIDATES the sweep runs (`candidates`), those of SM90_ONLY only on sm_90 or later."""
    import kernel
    target = kernel.device_target(torch.device(device))
    hopper = target.platform == "cuda" and target.arch >= 90
    return [i for i in ([int(i) for i in candidates.split(",")] if candidates else range(len(CANDIDATES)))
            if hopper or i not in SM90_ONLY]


def sweep_dtype():
    return torch.bfloat16 if device.startswith("cuda") else torch.float32  # the interpreter's bf16 dot is wrong


def sweep_case(tiling, kind, T, B, H, D, window, dtype):
    """One SWEEP_KINDS kind on the kernel by this tiling, input laid out as a model's: its out, dq, dk, dv, and
    functions that run its forward and its backward again."""
    import kernel
    g = torch.Generator(device=device).manual_seed(T)
    q, k, v = torch.randn(B, T, 3, H, D, device=device, generator=g).to(dtype).permute(2, 0, 3, 1, 4)
    dout = kernel._token_major(q).copy_(torch.randn(B, H, T, D, device=device, generator=g))
    r, perm = torch.rand(T, device=device, generator=g).sort()
    perm, r, width, margin = {"swa": (None, None, window, 0.0), "sa": (perm, None, window, 0.0),
                              "sa-value": (perm, r, window / T, 1e-6)}[kind]
    forward = lambda: kernel._forward(q, k, v, perm, r, width, margin, tiling)  # noqa: E731
    out, lse = forward()
    backward = lambda: kernel._backward(dout, q, k, v, out, lse, perm, r, width, margin, tiling)  # noqa: E731
    return [out, *backward()], forward, backward


def timed_ms(fn):
    """fn's time per call in ms: device time on a GPU (bench.device_ms), else the median wall time."""
    from bench import device_ms
    if device.startswith("cuda"):
        return device_ms(fn, sweep_reps)
    times = []
    for _ in range(sweep_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def sweep_stage(progress=writer("")):
    """Each of CANDIDATES (those `candidates` names) on the kernel's SWEEP_KINDS at each of sweep_sizes and
    sweep_shape: forward and backward ms, and the largest difference of out and gradients from choose_tiling's,
    relative as the self-check's (a tiling that cannot run: a row that says why). Then a profiler table of SA's
    forward and backward by choose_tiling's tiling."""
    import kernel
    from torch.profiler import ProfilerActivity, profile
    start, rows, cuda = time.time(), [], device.startswith("cuda")
    (B, H, D, window), dtype = map(int, sweep_shape.split(",")), sweep_dtype()
    default = kernel.choose_tiling(dtype, D, kernel.device_target(torch.device(device)))
    for T in map(int, sweep_sizes.split(",")):
        want = {kind: sweep_case(default, kind, T, B, H, D, window, dtype)[0] for kind in SWEEP_KINDS}
        for candidate in (CANDIDATES[i] for i in swept()):
            row = dict(T=T, candidate=candidate)
            try:
                for kind in SWEEP_KINDS:
                    got, forward, backward = sweep_case(default._replace(**candidate), kind, T, B, H, D, window, dtype)
                    row[f"{kind} diff"] = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(
                        min=1)).item() for a, b in zip(got, want[kind]))
                    row[f"{kind} fwd ms"], row[f"{kind} bwd ms"] = round(timed_ms(forward), 4), round(
                        timed_ms(backward), 4)
                row["ok"] = all(row[f"{kind} diff"] <= kernel.TOLERANCE[dtype] for kind in SWEEP_KINDS)
            except Exception as e:  # e.g. out of shared memory: the row says so
                row["error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
            rows.append(row)
            print(row, flush=True)
            progress(dict(status="running", rows=rows))
    _, forward, backward = sweep_case(default, "sa", int(sweep_sizes.split(",")[0]), B, H, D, window, dtype)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(3):
            forward(), backward()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=12)
    ok = rows and "error" not in rows[0] and all(r.get("ok", True) for r in rows)
    return dict(status="pass" if ok else "fail", seconds=round(time.time() - start, 1), rows=rows, output=table)


def bench_stage(limit, extra=()):
    """bench.py's table (in __main__: bf16, SDPA's "full", the kernel's SWA and SA and the fair FlexAttention
    peers, forward and forward+backward; with --base the base's kinds too), as rows read from its printed lines, so
    that a run cut off by the time limit keeps the rows it measured; and full/sa, full/flex-sa per mode and T beside
    the paper's full/sa, by device time where there is one, and this tree's time over the base's."""
    record = run([sys.executable, "results/bench.py", f"--device={device}", f"--sizes={sizes}",
                  f"--kinds={bench_kinds}", *bench_args.split(), *[f"--base={base}"] * bool(base), *extra], limit)
    rows = [dict(mode=m[1], T=int(m[2]), kind=m[3], ms=float(m[4]), device_ms=None if m[5] == "-" else float(m[5]),
                 peak_mib=float(m[6])) for m in
            re.finditer(r"^ *(fwd|fwd\+bwd) +(\d+) +(\S+) +([\d.]+) +([\d.]+|-) +(\d+)", record["output"], re.M)]
    ms = {(r["mode"], r["T"], r["kind"]): r["device_ms"] or r["ms"] for r in rows}
    record["rows"] = rows
    record["full_over"] = [dict(mode=m, T=T, kind=kind, ratio=round(ms[m, T, "full"] / t, 2),
                                paper_sa=PAPER_FULL_OVER_SA.get(T))
                           for (m, T, kind), t in ms.items() if kind in ("sa", "flex-sa") and (m, T, "full") in ms]
    record["over_base"] = [dict(mode=m, T=T, kind=kind, ratio=round(t / ms[m, T, f"base:{kind}"], 2))
                           for (m, T, kind), t in ms.items() if (m, T, f"base:{kind}") in ms]
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


def logged_speeds(log):
    """The speed records train.py has logged so far (whole lines only)."""
    try:
        with open(log) as f:
            return [r for r in (json.loads(line) for line in f if line.endswith("\n")) if "tok_per_s" in r]
    except OSError:
        return []


def train_stage(attn, gpu, limit, extra=()):
    """train.py's default model (GPT-2 small, 124M) with this attention on random tokens in a temporary folder (no
    download), a speed logged every iteration and no eval after the first: stopped once it has logged train_iters
    speeds after the first (which holds the compile), so that it never writes a checkpoint. tok/s and MFU: their
    median."""
    with tempfile.TemporaryDirectory() as tmp:
        random_tokens(os.path.join(tmp, "random"))
        log = os.path.join(tmp, "out", "log.jsonl")
        record = run([sys.executable, "train.py", f"--data_root={tmp}", "--dataset=random", f"--attn={attn}",
                      f"--out_dir={tmp}/out", "--max_iters=1000000", "--eval_interval=1000000", "--eval_iters=1",
                      "--log_interval=1", *train_args.split(), *extra], limit,
                     stop=lambda: len(logged_speeds(log)) > train_iters)
        speeds = logged_speeds(log)[1:train_iters + 1]
    if speeds:
        record["tok_per_s"] = statistics.median(r["tok_per_s"] for r in speeds)
        mfu = [r["mfu"] for r in speeds if r["mfu"] is not None]
        record["mfu_of_a100_peak"] = statistics.median(mfu) if mfu else None  # as train.py prints it
        peak = next((p for name, p in BF16_PEAK.items() if name in gpu), None)
        record["mfu"] = record["mfu_of_a100_peak"] * BF16_PEAK["A100"] / peak if mfu and peak else None
    return record


# The run

def results_path():
    """Where the results go: --out, else $OUT/gpu_check.json where OUT is set, else results/gpu_check.json."""
    return os.path.abspath(out or os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "results"),
                                               "gpu_check.json"))


def earlier_runs(path):
    """The runs a results file holds already (a file of one run, as gpu_check.py wrote before, is one), or []."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        doc = json.load(f)
    return doc["runs"] if "runs" in doc else [doc]


def stage_limits():
    """{stage: seconds} from `limits`, every stage named once."""
    pairs = [item.partition(":") for item in limits.split(",")]
    got = {name: float(seconds) for name, _, seconds in pairs if seconds.replace(".", "", 1).isdigit()}
    return got if len(got) == len(pairs) and set(got) == set(STAGES) else None


def provenance_now():
    from provenance import provenance
    return dict(provenance(), **{"commit": commit} if commit else {})


if __name__ == "__main__":
    exec(open(os.path.join(ROOT, "configurator.py")).read())
    from guards import need
    path, base = results_path(), base and os.path.abspath(base)  # before the chdir
    os.chdir(ROOT)  # kernel.py, results/bench.py and train.py run from the repo root
    if child:  # one in-process stage, in this child process: its record, after every step, at path
        stage, _, path = child.partition(":")
        progress = writer(path)
        try:
            progress({"compile": compile_stage, "self-check": self_check_stage, "sweep": sweep_stage}[stage](progress))
        except Exception:
            progress(dict(status="fail", output=traceback.format_exc()[-3000:]))
        sys.exit()
    if not device.startswith("cuda"):
        sys.exit("gpu_check.py needs a CUDA GPU, and torch sees none here (the CPU checks: python -m pytest -q)")
    todo, LIMITS = stages.split(","), stage_limits()
    need(set(todo) <= set(STAGES), f"stages={stages!r}: use some of {','.join(STAGES)}")
    need(LIMITS is not None, f"limits={limits!r}: give seconds for each of {','.join(STAGES)}, e.g. compile:40,...")
    need(not base or os.path.isfile(os.path.join(base, "attention.py")), f"base={base!r} holds no attention.py")
    need(all(i.isdigit() and int(i) < len(CANDIDATES) for i in candidates.split(",")) or not candidates,
         f"candidates={candidates!r}: name CANDIDATES by index, 0 to {len(CANDIDATES) - 1}, comma separated")
    try:
        runs = earlier_runs(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"gpu_check.py: cannot read the earlier results in {path} ({e}): move the file aside")
    import triton
    gpu, start = torch.cuda.get_device_name(), START
    result = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                  started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), budget=budget, stages={})
    write = writer(path)

    def limit(stage):
        return min(LIMITS[stage], budget - (time.time() - start))

    def save(name, record):
        result["stages"][name] = dict(record, **provenance_now())  # each stage: this commit and command
        write(dict(runs=runs + [result]))  # after every stage, so that a killed run keeps what it measured
        print(f"{name}: {record['status']} in {record['seconds']} s; {time.time() - start:.0f} of {budget} s so far",
              flush=True)

    def skipped():
        return dict(status="skipped", seconds=0, output="no time left in the budget")

    print(f"gpu_check on {gpu}: torch {torch.__version__}, Triton {triton.__version__}; writing {path}", flush=True)
    for stage in todo:
        if stage == "train":
            for pair in train_runs.split(","):
                T, batch = pair.split(":")
                for attn in ("full", "sa+swa"):
                    args = [f"--block_size={T}", f"--batch_size={batch}"]
                    save(f"train {attn} T={T}", train_stage(attn, gpu, limit(stage), args) if limit(stage) > 5
                         else skipped())
            continue
        if limit(stage) <= 5:
            save(stage, skipped())
        elif stage == "kernel":
            save(stage, kernel_stage(limit(stage)))
        elif stage == "speed":
            save(stage, bench_stage(limit(stage), ["--dtype=bfloat16", "--attn_engine=triton"]))
        else:
            save(stage, in_child(stage, limit(stage), sys.argv[1:] + [f"--base={base}"]))
        print(result["stages"][stage]["output"][-3000:], flush=True)
    for r in result["stages"].get("speed", {}).get("full_over", []):
        print(f"full/{r['kind']:<7} {r['mode']:>7} T={r['T']:<6} {r['ratio']:6.2f}x   (paper, A100: {r['paper_sa']}x)")
    for r in result["stages"].get("speed", {}).get("over_base", []):
        print(f"{r['kind']:>8} {r['mode']:>7} T={r['T']:<6} this tree's time / the base's: {r['ratio']:.2f}")
    for name, r in result["stages"].items():
        if name.startswith("train"):
            print(f"{name:<20}: {r.get('tok_per_s', 0):,.0f} tok/s, MFU {r.get('mfu')}, graph breaks "
                  f"{r.get('graph_breaks')} ({r['status']})")
    print(f"wrote {path} in {time.time() - start:.0f} s")
