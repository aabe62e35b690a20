"""
CPU benchmark of attention.py's torch paths against full attention (SDPA), forward and
forward+backward, with peak memory. Prints one table; ratios within one run are what count.

    python bench.py                                  # T = 1024, 4096, 16384
    python bench.py --sizes=4096 --json_out=speed.json   # one size, and the table as JSON

Each measurement runs in a fresh process, so that its peak resident memory can be read.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import attention as A

# -----------------------------------------------------------------------------
sizes = "1024,4096,16384"  # sequence lengths T, comma separated
kinds = "full,swa,sa,sa-bht,sa-value,moba,flex-sa"  # what to time (sa-value: SA's value rule, delta = window / T;
                                                     # flex-sa: compiled FlexAttention, forward only)
modes = "fwd,fwd+bwd"      # forward only, and forward + backward (training)
reps = 5                   # timed repetitions after one warm-up; the median is reported
threads = 2                # torch threads
B, H, D = 1, 8, 64         # batch, heads, head dim
window = 256               # SWA / SA window
moba_block, moba_topk = 64, 4
json_out = ""              # also write the rows and the table here
case = ""                  # internal: "kind,mode,T" measures one case in this process
# -----------------------------------------------------------------------------
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())


def attention_fn(kind, T):
    """The function of (q, k, v) that `kind` names, with its permutation drawn once."""
    perm = torch.randperm(T)
    if kind == "full":
        return A.full_attention
    if kind == "swa":
        return lambda q, k, v: A.sliding_window_attention(q, k, v, window)
    if kind == "sa":
        return lambda q, k, v: A.stochastic_attention(q, k, v, window, perm)
    if kind == "sa-bht":
        perm = torch.rand(B, H, T).argsort(-1)
        return lambda q, k, v: A.stochastic_attention(q, k, v, window, perm)
    if kind == "sa-value":
        r = torch.rand(T)
        return lambda q, k, v: A.stochastic_value_attention(q, k, v, window / T, r)
    if kind == "moba":
        return lambda q, k, v: A.moba_attention(q, k, v, moba_block, moba_topk)
    if kind == "flex-sa":  # the peer: FlexAttention with SA's rule as a mask_mod, compiled
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        slot = torch.argsort(perm)
        block_mask = create_block_mask(lambda b, h, i, j: ((slot[i] - slot[j]).abs() < window) & (j <= i),
                                       None, None, T, T, device="cpu")
        flex = torch.compile(flex_attention)
        return lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown kind {kind!r}")


def measure(kind, mode, T):
    """(median seconds, peak RSS in MiB above the inputs) of one case, in this process."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    A.BACKEND = "torch"
    fn = attention_fn(kind, T)
    q, k, v = (torch.randn(B, H, T, D, requires_grad=mode != "fwd") for _ in range(3))
    dout = torch.randn(B, H, T, D)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        if mode == "fwd":
            with torch.no_grad():
                fn(q, k, v)
        else:
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024


if __name__ == "__main__":
    if case:
        kind, mode, T = case.split(",")
        print(*measure(kind, mode, int(T)))
        sys.exit()
    head = (f"B={B} H={H} D={D} fp32, window {window}, MoBA block {moba_block} top_k {moba_topk}; torch "
            f"{torch.__version__}, {threads} threads on {os.cpu_count()} CPUs ({os.uname().machine}); median of "
            f"{reps} after a warm-up; peak RSS above the inputs, each case in a fresh process")
    lines = [head, f"{'mode':>8} {'T':>6} {'kind':>8} {'ms':>9} {'peak MiB':>9} {'full/this':>10}"]
    print("\n".join(lines), flush=True)
    rows = []
    for mode in modes.split(","):
        for T in map(int, sizes.split(",")):
            res = {}
            for kind in kinds.split(","):
                if kind == "flex-sa" and mode != "fwd":
                    continue  # FlexAttention has no CPU backward
                cmd = [sys.executable, __file__, f"--case={kind},{mode},{T}", f"--reps={reps}", f"--threads={threads}"]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    line = f"{mode:>8} {T:>6} {kind:>8}  failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:80]}"
                else:
                    s, mib = (float(x) for x in out.stdout.split()[-2:])
                    res[kind] = s
                    rows.append(dict(mode=mode, T=T, kind=kind, ms=1000 * s, peak_mib=mib))
                    ratio = f"{res['full'] / s:>9.2f}x" if "full" in res else ""
                    line = f"{mode:>8} {T:>6} {kind:>8} {1000 * s:>9.1f} {mib:>9.0f} {ratio}"
                lines.append(line)
                print(line, flush=True)
            if "sa" in res and "swa" in res:
                lines.append(f"{'':>8} {'':>6} {'sa/swa':>8} {res['sa'] / res['swa']:>9.2f}x")
                print(lines[-1], flush=True)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(rows=rows, table="\n".join(lines)), f, indent=1)


def benchmark_generation(lengths=(256, 1024, 4096), new_tokens=(5, 33), vocab_size=512):
    """GPT.generate's speed: ms per generated token, for every attention kind, with and without the KV
    cache (kv_cache.py), after prompts of each length, on a small random model built here. A step is timed
    from the end of one forward of generate to the end of the next (a forward hook), so the prompt's
    prefill is left out; the median step, to shrug off other processes. new_tokens[use_cache] steps each.
        python -c "import bench; bench.benchmark_generation()"
    """
    from model import ATTN_KINDS, GPT, GPTConfig
    arch = dict(n_layer=4, n_head=4, n_embd=128, window=64, moba_block=64, moba_topk=4,
                vocab_size=vocab_size, block_size=max(lengths) + max(new_tokens))
    print(f"generate, greedy, batch 1, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}; a random "
          f"GPT {', '.join(f'{k}={v}' for k, v in arch.items())}; median ms per generated token, prefill excluded; "
          f"cache slots per layer: window for swa, block_size for the others")
    print(f"{'attn':>7} {'sa_rule':>7} {'prompt':>6} {'no cache':>9} {'cache':>9} {'speedup':>8}")
    for attn, rule in [(a, "rank") for a in ATTN_KINDS] + [("sa", "value"), ("sa+swa", "value")]:
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
    print("n/a: rank-rule SA cannot be decoded from a cache exactly (see GPT.generate)")
