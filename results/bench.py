"""
Benchmark of attention.py's functions against full attention (SDPA) and against FlexAttention, forward
and forward+backward, with peak memory. Prints one table; ratios within one run are what count.

    python results/bench.py                                  # T = 1024, 4096, 16384 on the CPU
    python results/bench.py --sizes=4096 --json_out=speed.json   # one size, and the table as JSON
    python results/bench.py --device=cuda --dtype=bfloat16 --attn_engine=auto  # a GPU: the Triton kernel (gpu_check.py)
    python results/bench.py --generation=True                # GPT.generate, with and without the KV cache
    python results/bench.py --device=cuda --base=.base       # also a change's base (its attention.py), alternately

On the CPU each measurement runs in a fresh process, so that its peak resident memory can be read
(with THP_MEM_ALLOC_ENABLE=thp: huge pages, so fewer page faults on fresh buffers, for every kind);
on a GPU all run in this process, with the peak of torch.cuda's allocator. Two times per call: "wall ms", each
call waited for (the host's work and launches included, as a step that syncs pays them), and on a GPU "device
ms", CUDA events around `reps` calls made back to back (the GPU's time, as a step that never syncs pays it:
the host runs ahead). full/this is by device ms on a GPU. Each kind's dO is laid out as its output, as a loss's
gradient is: no kind pays for a copy of it. With --base, the kinds that run attention.py's band are timed for the base
checkout too (rows "base:<kind>"), base and this one alternately, `rounds` rounds each (median), on a GPU in this
process (Checkout), on the CPU each case in a fresh process.
The FlexAttention peers are what a Flex user writes: compiled flex_attention (dynamic=False: one
compile per shape, as training's fixed T) with a BlockMask built
from block indices (never a T x T mask) that lists only the key blocks the band reaches. flex-sa
gathers q, k, v into SA's slot order, runs the band |s - t| < window with mask_mod
pos[t] <= pos[s] (attention.py's rule) and scatters back. FlexAttention has no backward on the CPU.
"""
import contextlib
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = next((a[len("--modules="):] for a in sys.argv if a.startswith("--modules=")), "") or ROOT
sys.path.insert(0, MODULES)  # the attention.py (and its modules) timed: this repo's, or another checkout's
import attention as A  # noqa: E402
from guards import need  # noqa: E402

# -----------------------------------------------------------------------------
sizes = "1024,4096,16384"  # sequence lengths T, comma separated
kinds = "full,swa,sa,sa-bht,sa-value,moba,flex-swa,flex-sa"  # what to time (sa-value: SA's value rule,
                           # delta = window / T; flex-*: FlexAttention, forward only on the CPU)
modes = "fwd,fwd+bwd"      # forward only, and forward + backward (training)
reps = 5                   # timed repetitions after one warm-up; the median is reported
threads = 2                # torch threads
thp = 1                    # CPU: each case with THP_MEM_ALLOC_ENABLE=thp, PyTorch's CPU tuning setting (large
                           # tensors on 2 MB pages: fewer page faults on fresh buffers); 0 is PyTorch's default
batch, heads, head_dim = 1, 8, 64  # B, H, D of q, k, v
window = 256               # SWA / SA window
moba_chunk, moba_topk = 64, 4
flex_block = 128           # FlexAttention's block size (its default)
device = "cpu"             # cpu or cuda
dtype = "float32"          # float32, bfloat16 or float16: the dtype of q, k, v
attn_engine = "torch"      # attention.ATTN_ENGINE: "auto" runs the Triton kernel on a GPU
json_out = ""              # also write the rows and the table here
modules = ""               # another checkout whose attention.py to time instead of this one's
base = ""                  # a change's base checkout: its kinds in BASE_KINDS timed too, alternately with this one's
rounds = 3                 # with base: rounds of base then this checkout, per case (the median is reported)
case = ""                  # internal: "kind,mode,T" measures one case in this process
generation = False         # time GPT.generate instead, with and without the KV cache (benchmark_generation)
# -----------------------------------------------------------------------------
KINDS = ("full", "swa", "sa", "sa-bht", "sa-value", "moba", "flex-swa", "flex-sa")
BASE_KINDS = ("swa", "sa", "sa-bht", "sa-value", "moba")  # run attention.py's own band (full is SDPA, Flex bench's)
MODES = ("fwd", "fwd+bwd")


def band_block_mask(T, lo, hi, mask_mod, full_blocks):
    """FlexAttention's BlockMask for the band lo <= s - t <= hi (query slot s, key slot t) and mask_mod,
    built from block indices (no T x T mask): only the key blocks the band reaches. Where full_blocks
    (mask_mod is the band alone), blocks wholly inside the band are full: Flex skips mask_mod there."""
    from torch.nn.attention.flex_attention import BlockMask
    n = -(-T // flex_block)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]      # query block, key block
    s_t = ((i - j) * flex_block - (flex_block - 1), (i - j) * flex_block + (flex_block - 1))  # min, max s - t  # (n, n)
    reached = (s_t[1] >= lo) & (s_t[0] <= hi)
    full = reached & (s_t[0] >= lo) & (s_t[1] <= hi) & ((j + 1) * flex_block <= T) & full_blocks

    def listed(blocks):  # (1, 1, n) counts, (1, 1, n, n) key block indices, the listed ones first
        order = blocks.int().argsort(dim=-1, descending=True, stable=True)
        return blocks.sum(-1, dtype=torch.int32)[None, None].to(device), order.int()[None, None].to(device)
    return BlockMask.from_kv_blocks(*listed(reached & ~full), *listed(full), BLOCK_SIZE=flex_block,
                                    mask_mod=mask_mod, seq_lengths=(T, T))


def flex_band(*band):
    """Compiled flex_attention with band_block_mask(*band)."""
    from torch.nn.attention.flex_attention import flex_attention
    mask, flex = band_block_mask(*band), torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=mask)


class Checkout:
    """Another checkout's attention.py, and the repo modules it imports, loaded beside this one's in this process:
    `with checkout as A:` runs A's functions with sys.modules pointing at its modules (attention.py imports kernel in
    a function). Its kernel.py registers torch ops under our ops' names: harmless eagerly, as here (each kernel.py's
    autograd function calls its own code), wrong under torch.compile."""

    def __init__(self, root):
        names = [n[:-3] for n in os.listdir(root) if n.endswith(".py")]  # its top-level modules
        saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
        sys.path.insert(0, root)
        try:
            self.A = importlib.import_module("attention")
            if importlib.util.find_spec("triton"):
                importlib.import_module("kernel")  # now, not at its first call (under our modules)
        finally:
            sys.path.remove(root)
            self.modules = {n: sys.modules.pop(n) for n in names if n in sys.modules}
            sys.modules.update(saved)

    def __enter__(self):
        self.saved = {n: sys.modules.get(n) for n in self.modules}
        sys.modules.update(self.modules)
        return self.A

    def __exit__(self, *exc):
        for n, m in self.saved.items():
            sys.modules.pop(n) if m is None else sys.modules.update({n: m})


def attention_fn(kind, T, A=A):
    """The function of (q, k, v) that `kind` names, with its permutation drawn once; A: the attention module."""
    perm = torch.randperm(T, device=device)
    if kind == "full":
        return A.full_attention
    if kind == "swa":
        return lambda q, k, v: A.sliding_window_attention(q, k, v, window)
    if kind == "sa":
        return lambda q, k, v: A.stochastic_attention(q, k, v, window, perm)
    if kind == "sa-bht":
        perm = torch.rand(batch, heads, T, device=device).argsort(-1)  # (B, H, T)
        return lambda q, k, v: A.stochastic_attention(q, k, v, window, perm)
    if kind == "sa-value":
        r = torch.rand(T, device=device)
        return lambda q, k, v: A.stochastic_value_attention(q, k, v, window / T, r)
    if kind == "moba":
        return lambda q, k, v: A.moba_attention(q, k, v, moba_chunk, moba_topk)
    if kind == "flex-swa":
        return flex_band(T, 0, window - 1, lambda b, h, s, t: (t <= s) & (s - t < window), True)
    if kind == "flex-sa":  # slot s holds token perm[s]: gather into slot order, the band, scatter back
        band = flex_band(T, 1 - window, window - 1,
                         lambda b, h, s, t: ((s - t).abs() < window) & (perm[t] <= perm[s]), False)
        slot = torch.argsort(perm)  # (T,) the slot of each token
        return lambda q, k, v: band(*(t.index_select(2, perm) for t in (q, k, v))).index_select(2, slot)  # (B, H, T, D)
    raise ValueError(f"unknown kind {kind!r}")


def measure(kind, mode, T, A=A):
    """(median wall seconds, device seconds or None, peak MiB above the inputs) of one case, in this process: peak RSS
    on the CPU (so run each case in a fresh process there), torch.cuda's peak allocation on a GPU."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    name = next(n for n in ("ATTN_ENGINE", "ENGINE", "IMPL") if hasattr(A, n))  # older checkouts' names
    setattr(A, name, attn_engine)
    fn = attention_fn(kind, T, A)
    shape = (batch, heads, T, head_dim)  # (B, H, T, D)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=getattr(torch, dtype)) for _ in range(4))
    q, k, v = (t.requires_grad_(mode != "fwd") for t in (q, k, v))
    douts = {d.stride(): d for d in (dout, dout.transpose(1, 2).contiguous().transpose(1, 2))}  # (B, H, T, D) or
    # (B, T, H, D) in memory (the kernel's output, and so training's dO): each output gets dO in its own layout
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    def call():
        if mode == "fwd":
            with torch.no_grad():
                fn(q, k, v)
        else:
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), douts.get(out.stride(), dout))
    times = []
    for _ in range(reps + 1):  # wall: each call waited for
        t0 = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return statistics.median(times[1:]), device_ms(call, reps) / 1000 if cuda else None, (peak - base) / 2**20


def device_ms(fn, reps=10):
    """fn's GPU time per call: CUDA events around reps calls made back to back, after one."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def check_settings():
    """Each setting's rule beyond guards.CHECKS (which configurator.py checks): one InputError line."""
    bad = next((k for k in kinds.split(",") if k not in KINDS), None)
    need(bad is None, f"kinds={kinds!r}: unknown kind {bad!r} (kinds: {','.join(KINDS)})")
    bad = next((m for m in modes.split(",") if m not in MODES), None)
    need(bad is None, f"modes={modes!r}: unknown mode {bad!r} (modes: {','.join(MODES)})")
    need(all(t.strip().isdigit() and int(t) >= 1 for t in sizes.split(",")), f"sizes={sizes!r}: give sequence lengths "
         ">= 1, comma separated, e.g. --sizes=1024,4096")
    need(thp in (0, 1), f"thp={thp}: use 1 (huge pages) or 0")
    need(not base or os.path.isfile(os.path.join(base, "attention.py")), f"base={base!r} holds no attention.py")
    one = case.split(",")
    need(not case or len(one) == 3 and one[0] in KINDS and one[1] in MODES and one[2].isdigit() and int(one[2]) >= 1,
         f"case={case!r}: use kind,mode,T (internal: the one case that a fresh process measures)")


def benchmark_generation(lengths=(256, 1024, 4096), new_tokens=(5, 33), vocab_size=512):
    """GPT.generate's speed: ms per generated token, for every attention kind, with and without the KV
    cache (kv_cache.py), after prompts of each length, on a small random model built here. A step is timed
    from the end of one forward of generate to the end of the next (a forward hook), so the prompt's
    prefill is left out; the median step, to shrug off other processes. new_tokens[use_cache] steps each.
        python results/bench.py --generation=True
    """
    from model import ATTNS, GPT, GPTConfig
    arch = dict(n_layer=4, n_head=4, n_embd=128, window=64, moba_chunk=64, moba_topk=4,
                vocab_size=vocab_size, block_size=max(lengths) + max(new_tokens))
    print(f"generate, greedy, batch 1, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}; a random "
          f"GPT {', '.join(f'{k}={v}' for k, v in arch.items())}; median ms per generated token, prefill excluded; "
          f"cache cells per layer: window for swa, block_size for the others")
    print(f"{'attn':>7} {'sa_rule':>7} {'prompt':>6} {'no cache':>9} {'cache':>9} {'speedup':>8}")
    for attn, rule in [(a, "rank") for a in ATTNS] + [("sa", "value"), ("sa+swa", "value")]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(attn=attn, sa_rule=rule, **arch)).eval()
        stamps = []
        model.register_forward_hook(lambda *_: stamps.append(time.perf_counter()))
        model.generate(torch.zeros(1, 8, dtype=torch.long), 2, use_cache=False)  # warm-up
        for T in lengths:
            x = torch.randint(vocab_size, (1, T))
            ms = {}
            for cached in (False, True) if model.config.cacheable else (False,):
                stamps.clear()
                model.generate(x, 1 + new_tokens[cached], temperature=0, use_cache=cached)
                ms[cached] = 1000 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
            row = f"{attn:>7} {rule if attn in ('sa', 'sa+swa') else '':>7} {T:>6} {ms[False]:>9.2f}"
            row += f" {ms[True]:>9.2f} {ms[False] / ms[True]:>7.1f}x" if True in ms else f" {'n/a':>9}"
            print(row, flush=True)
    print("n/a: rank-rule SA has no exact KV cache (GPTConfig.cacheable says why)")


if __name__ == "__main__":
    exec(open(os.path.join(ROOT, "configurator.py")).read())
    try:
        check_settings()
    except ValueError as e:
        sys.exit(f"bench.py: {e}")
    if case:
        kind, mode, T = case.split(",")
        s, _, mib = measure(kind, mode, int(T))
        print(s, mib)
        sys.exit()
    if generation:
        benchmark_generation()
        sys.exit()
    cuda = device.startswith("cuda")
    where = (f"{torch.cuda.get_device_name(device)}, all cases in one process, peak allocated above the inputs"
             if cuda else f"{threads} threads on {os.cpu_count()} CPUs ({os.uname().machine}), peak RSS above "
             f"the inputs, each case in a fresh process with THP_MEM_ALLOC_ENABLE={thp}")
    head = (f"B={batch} H={heads} D={head_dim} {dtype}, window {window}, MoBA chunk {moba_chunk} top_k "
            f"{moba_topk}, Flex block {flex_block}, attention.ATTN_ENGINE={attn_engine} of {MODULES}; torch "
            f"{torch.__version__}; median of {reps} after a warm-up; {where}")
    lines = [head, f"{'mode':>8} {'T':>6} {'kind':>13} {'wall ms':>9} {'device ms':>9} {'peak MiB':>9} "
             f"{'full/this':>10}"]
    print("\n".join(lines), flush=True)
    torch._dynamo.config.cache_size_limit = 64  # in one process, Flex recompiles for every T, mask and mode
    checkout = Checkout(base) if base and cuda else None  # the base's modules beside ours (GPU: one process)

    def one(kind, mode, T, side):
        """(wall s, device s or None, peak MiB) of one case, or its error's line; side "base": the base's modules."""
        if cuda:
            try:
                with checkout if side == "base" else contextlib.nullcontext(A) as attention:
                    return measure(kind, mode, T, attention)
            except Exception as e:  # e.g. out of memory: the row says so, the others still run
                torch.cuda.empty_cache()
                return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        cmd = [sys.executable, __file__, *[f"--modules={base}"] * (side == "base"), *sys.argv[1:],
               f"--case={kind},{mode},{T}"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, THP_MEM_ALLOC_ENABLE=str(thp)))
        if out.returncode:
            return (out.stderr.strip().splitlines() or ["?"])[-1]
        s, mib = (float(x) for x in out.stdout.split()[-2:])
        return s, None, mib

    rows = []
    for mode in modes.split(","):
        for T in map(int, sizes.split(",")):
            res = {}
            for kind in kinds.split(","):
                if kind.startswith("flex") and mode != "fwd" and not cuda:
                    continue  # FlexAttention has no CPU backward
                sides = ("base", "after") if base and kind in BASE_KINDS else ("after",)
                got = {side: [] for side in sides}
                for _ in range(rounds if len(sides) > 1 else 1):  # base and this checkout alternately
                    for side in sides:
                        got[side].append(one(kind, mode, T, side))
                for side, runs in got.items():
                    name = f"base:{kind}" if side == "base" else kind
                    error = next((run for run in runs if isinstance(run, str)), None)
                    if error:
                        line = f"{mode:>8} {T:>6} {name:>13}  failed: {error[:100]}"
                    else:
                        s, dev, mib = (None if x[0] is None else statistics.median(x) for x in zip(*runs))
                        res[name] = dev or s
                        rows.append(dict(mode=mode, T=T, kind=name, ms=1000 * s, device_ms=dev and 1000 * dev,
                                         peak_mib=mib, rounds=len(runs)))
                        ratio = f"{res['full'] / res[name]:>9.2f}x" if "full" in res else ""
                        ms = f"{1000 * dev:>9.3f}" if dev else f"{'-':>9}"
                        line = f"{mode:>8} {T:>6} {name:>13} {1000 * s:>9.{3 if cuda else 1}f} {ms} {mib:>9.0f} {ratio}"
                    lines.append(line)
                    print(line, flush=True)
            pairs = [("sa", "swa"), ("sa", "flex-sa"), ("swa", "flex-swa")] + [(k, f"base:{k}") for k in BASE_KINDS]
            for a, b in pairs:
                if a in res and b in res:
                    lines.append(f"{'':>8} {'':>6} {f'{a}/{b}':>13} {res[a] / res[b]:>9.2f}x")
                    print(lines[-1], flush=True)
    if not rows:
        sys.exit("bench.py: every case failed (see the rows above)")
    try:  # atomically: a full disk leaves no half-written json_out
        if json_out:
            from provenance import provenance  # each row: this commit and command
            os.makedirs(os.path.dirname(json_out) or ".", exist_ok=True)
            with open(json_out + ".tmp", "w") as f:
                json.dump(dict(rows=[dict(r, **provenance()) for r in rows], table="\n".join(lines)), f, indent=1)
            os.replace(json_out + ".tmp", json_out)
    except OSError as e:
        sys.exit(f"bench.py: cannot write {json_out}: {e.strerror or e} (the table above is complete)")
