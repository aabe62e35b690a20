"""
Receptive-field coverage of an L-layer attention stack: how many layers until information from every token
can reach every query that may see it? SWA needs exactly ceil((n-1)/(w-1)) layers; the paper's claim is that
SA's fresh permutations need about log_w n. This measures it exactly, with no sampled tokens.

  python results/receptive_field.py --n=16384 --window=16 --kind=sa+swa
  python results/receptive_field.py --setting=bidirectional --kind=sa --heads=4
  python results/receptive_field.py --n=16384 --window=16 --kind=sa+swa --sa_rule=value
  python results/receptive_field.py --grid=True --json_out=results/coverage.json --plot=results/coverage.png

Each token keeps, as a bitset, the set of tokens whose information has reached it, and a layer ORs together
the sets of the keys that each query reads: O(n * w * n/64) word operations per layer, never an n x n product.
"""
import json
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo's modules
from guards import path_problem  # noqa: E402
from prepare_data import pyplot  # noqa: E402
from provenance import provenance  # noqa: E402

# -----------------------------------------------------------------------------
n = 4096                # sequence length
window = 16             # w, attention.py's `window`
kind = "sa+swa"         # swa | sa | sa+swa (both paths in every layer, as in the gated model)
heads = 1               # SA permutations per layer (one per head); the layer's graph is their union
sa_rule = "rank"        # rank (permuted slots, the paper) | value (fresh keys r: a, b interact iff |r_a - r_b| < w / n)
# causal: attention.py's rules, and every pair j <= i must get connected. bidirectional: the paper's theorem, the
# same band without the causal rule (up to 2w - 1 keys, not wrapping around the ends), and every pair must.
setting = "causal"
seeds = 5               # runs with seeds 0..seeds-1, reported as median [min-max]
max_layers = 64         # give up after this many layers, reported as ">max_layers" (swa too: the table has its formula)
grid = False            # run every grid_runs entry for every n in grid_n and w in grid_window, print a table
grid_n = "256,1024,4096,16384"  # comma list of n
grid_window = "16,64"           # comma list of w
grid_runs = "causal:swa,causal:sa,causal:sa+swa,bidirectional:sa"  # comma list of setting:kind
json_out = ""           # write all results (per-seed layer counts, pairs connected per layer) here
plot = ""               # plot coverage against depth here (needs matplotlib)
# -----------------------------------------------------------------------------
KINDS = ("swa", "sa", "sa+swa")
SA_RULES = ("rank", "value")
CHECKS = ("causal", "bidirectional")
PIECE_WORDS = 1 << 18   # uint64 words gathered at once (2 MiB: stays in cache for the OR-reduce)
PROGRESS_BYTES = 1 << 28  # print every layer's progress above this many bytes of bitsets (n > ~46000)


def check(n, window, kind, setting, heads, seeds, max_layers, sa_rule="rank"):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if sa_rule not in SA_RULES:
        raise ValueError(f"sa_rule must be one of {SA_RULES}, got {sa_rule!r}")
    if setting not in CHECKS:
        raise ValueError(f"setting must be one of {CHECKS}, got {setting!r}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2 (window=1 only sees itself), got {window!r}")
    for name, value, low in (("n", n, 2), ("heads", heads, 1), ("seeds", seeds, 1), ("max_layers", max_layers, 1)):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def band(perm, lo, hi, causal):
    """Slot s holds token perm[s] and reads the key slots [lo[s], hi[s]); if causal a query only
    reads keys b <= a. Returns the candidate keys of every token, (n, K) in token order, and
    which of them are allowed."""
    n = len(perm)
    s = lo[:, None] + np.arange((hi - lo).max())                # (n, K) key slots; row = query slot
    ok = s < hi[:, None]
    key = perm[s.clip(0, n - 1)]                               # (n, K) key tokens
    if causal:
        ok &= key <= perm[:, None]
    slot = np.argsort(perm)                                    # (n,) slot of each token
    return key[slot], ok[slot]                                 # (n, K) rows in token order


def rank_band(perm, window, causal):
    """attention.py's rank rule: tokens a and b interact iff their slots are fewer than `window` apart."""
    s, w = np.arange(len(perm)), min(window, len(perm))        # a wider band changes nothing
    return band(perm, np.maximum(s - w + 1, 0), np.minimum(s + w, len(perm)), causal)


def value_band(r, delta, causal):
    """attention.py's value rule: tokens a and b interact iff |r_a - r_b| < delta; sorted by r,
    each token's keys are one span of slots."""
    perm = np.argsort(r, kind="stable")
    rs = r[perm]                                               # (n,) ascending
    return band(perm, np.searchsorted(rs, rs - delta, "right"), np.searchsorted(rs, rs + delta, "left"), causal)


def layer_graph(n, window, kind, setting, draws, sa_rule="rank"):
    """One layer's graph: query i reads the distinct keys keys[i, :count[i]]
    (always including i); keys is (n, K), padded with i itself. draws: SA's draws
    of this layer, one per head (ignored by swa): permutations, or keys r."""
    causal = setting == "causal"
    parts = [rank_band(np.arange(n), window, causal)] if kind != "sa" else []
    if kind != "swa":
        parts += [rank_band(p, window, causal) if sa_rule == "rank" else value_band(p, window / n, causal)
                  for p in draws]
    key = np.concatenate([np.where(ok, k, n) for k, ok in parts], 1)  # (n, paths*(2w-1)), n = not allowed
    key.sort(1)
    key[:, 1:][key[:, 1:] == key[:, :-1]] = n                  # a key reached by two paths counts once
    key.sort(1)
    count = (key < n).sum(1)                                   # (n,)
    key = key[:, :count.max()]                                 # (n, K)
    return np.where(key < n, key, np.arange(n)[:, None]), count


def identity_bits(n):
    """R[i] is the set of tokens whose information has reached token i, one bitset per token: row i of an
    (n, ceil(n/64)) uint64 array, token j is bit j % 64 of word j // 64. Before any layer, i itself."""
    R = np.zeros((n, -(-n // 64)), np.uint64)                  # (n, W)
    t = np.arange(n)
    R[t, t >> 6] = np.left_shift(np.uint64(1), (t & 63).astype(np.uint64))
    return R


def apply_layer(R, keys, count, causal):
    """R'[i] = OR of R[j] over the keys j that query i reads, in pieces of rows.
    Causal rows i < b only hold bits j <= i, so piece a:b reads b/64 words."""
    n, W = R.shape
    out = np.zeros_like(R)
    rows = max(1, PIECE_WORDS // (W * keys.shape[1]))
    for a in range(0, n, rows):
        b = min(a + rows, n)
        K, Wb = count[a:b].max(), (-(-b // 64) if causal else W)
        g = R[keys[a:b, :K].ravel(), :Wb]                                      # ((b-a)*K, Wb)
        out[a:b, :Wb] = np.bitwise_or.reduce(g.reshape(b - a, K, Wb), axis=1)  # (b-a, Wb)
    return out


def pairs(n, setting):
    """(query, key) pairs that must get connected, self pairs included."""
    return n * (n + 1) // 2 if setting == "causal" else n * n


def bitset_bytes(n):
    """The bytes of one layer's bitsets R, (n, ceil(n/64)) uint64."""
    return n * -(-n // 64) * 8


def check_memory(n):
    """The memory n needs, said up front: two layers' bitsets, 2 * n * ceil(n/64) * 8 bytes (n = 16384: 64 MiB;
    n = 200000: 9.3 GiB). A one-line ValueError if it cannot fit."""
    need, gib = 2 * bitset_bytes(n), lambda b: f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > avail:
        fits = int(math.sqrt(0.8 * avail / 2 * 8)) // 1000 * 1000  # a margin for the key tables
        raise ValueError(f"n={n} needs {gib(need)} (two layers' bitsets of n * n/8 bytes), but {gib(avail)} is "
                         f"available: use n <= {fits}")
    print(f"n={n}: {gib(need)} of bitsets (of {gib(avail)} available)", file=sys.stderr, flush=True)


def simulate(n, window, kind, setting, heads, max_layers, seed, sa_rule="rank"):
    """One stack with fresh permutations per layer. Returns (layers until every
    allowed pair is connected, layers until the last token sees all n tokens,
    connected pairs after layers 0..L); a layer count is None past max_layers.
    Prints each layer's progress to stderr when the bitsets pass PROGRESS_BYTES."""
    rng = np.random.default_rng(seed)
    causal = setting == "causal"
    total = pairs(n, setting)
    R = identity_bits(n)
    covered, all_pairs, last = [n], None, None
    t0, verbose = time.perf_counter(), bitset_bytes(n) >= PROGRESS_BYTES
    for layer in range(1, max_layers + 1):
        draws = [rng.permutation(n) if sa_rule == "rank" else rng.random(n)
                 for _ in range(heads if kind != "swa" else 0)]
        R = apply_layer(R, *layer_graph(n, window, kind, setting, draws, sa_rule), causal)
        covered.append(int(np.bitwise_count(R).sum(dtype=np.int64)))
        if verbose:
            print(f"{setting} {kind} n={n} w={window} seed {seed}: layer {layer}, {covered[-1] / total:.4f} of pairs "
                  f"connected, {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        if last is None and int(np.bitwise_count(R[-1]).sum()) == n:
            last = layer
        if covered[-1] == total:
            all_pairs = layer
            break
    return all_pairs, last, covered


def measure(n, window, kind, setting, heads=1, seeds=5, max_layers=64, sa_rule="rank"):
    """Every seed of one configuration (swa is deterministic: one run): layers until every allowed pair is
    connected, layers until the last token sees every token (its whole past when causal), and the covered
    pairs after each layer, which table() and make_plot() report as median [min-max] over seeds."""
    check(n, window, kind, setting, heads, seeds, max_layers, sa_rule)
    t0 = time.perf_counter()
    runs = [simulate(n, window, kind, setting, heads, max_layers, s, sa_rule)
            for s in range(1 if kind == "swa" else seeds)]
    return dict(setting=setting, kind=kind, sa_rule=sa_rule, n=n, window=window, heads=heads, max_layers=max_layers,
                log_w_n=math.log(n) / math.log(window), swa_exact=math.ceil((n - 1) / (window - 1)),
                all_pairs=[r[0] for r in runs], last_token=[r[1] for r in runs],
                pairs=pairs(n, setting), covered=[r[2] for r in runs], seconds=time.perf_counter() - t0)


def spread(values, cap):
    """'median [min-max]' of layer counts, None meaning more than cap."""
    def f(x):
        return f">{cap}" if x == math.inf else f"{x:g}"
    v = sorted(math.inf if x is None else x for x in values)
    med = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    return f(med) if v[0] == v[-1] else f"{f(med)} [{f(v[0])}-{f(v[-1])}]"


def median_curve(res):
    """Median covered fraction after layers 0..L; a run that stopped early stays covered."""
    L = max(len(c) for c in res["covered"])
    return np.median([c + [c[-1]] * (L - len(c)) for c in res["covered"]], axis=0) / res["pairs"]


def table(results):
    lines = ["| setting | kind | SA rule | heads | n | w | log_w n | SWA ⌈(n-1)/(w-1)⌉ | layers: all pairs "
             "| layers: last token | covered at end | seconds |", "|" + " --- |" * 12]
    for r in results:
        rule = r.get("sa_rule", "rank") if r["kind"] != "swa" else ""
        lines.append(f"| {r['setting']} | {r['kind']} | {rule} | {r['heads']} | {r['n']} | {r['window']} "
                     f"| {r['log_w_n']:.2f} | {r['swa_exact']} | {spread(r['all_pairs'], r['max_layers'])} "
                     f"| {spread(r['last_token'], r['max_layers'])} | {median_curve(r)[-1]:.4f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def make_plot(results, path):
    """One panel per (w, n): the fraction of pairs NOT yet connected against
    depth, log-log, so that slow tails show; a curve that reaches full coverage
    drops to the bottom edge and ends in a triangle."""
    plt = pyplot("--plot")
    ws, ns = sorted({r["window"] for r in results}), sorted({r["n"] for r in results})
    fig, axes = plt.subplots(len(ws), len(ns), figsize=(3.2 * len(ns) + 1, 2.8 * len(ws) + 0.8),
                             squeeze=False, sharex=True)
    for r in results:
        ax, bottom = axes[ws.index(r["window"])][ns.index(r["n"])], 0.3 / r["pairs"]
        missing = np.maximum(1 - median_curve(r), bottom)[1:]    # layers 1..L; 0 drawn at the bottom edge
        suffix = f" x{r['heads']} heads" if r["heads"] > 1 and r["kind"] != "swa" else ""
        label = f"{r['setting']} {r['kind']}{suffix}"
        line, = ax.plot(np.arange(1, len(missing) + 1), missing, label=label)
        if missing[-1] == bottom:
            ax.plot(len(missing), bottom, "v", color=line.get_color(), clip_on=False)
        ax.set(xscale="log", yscale="log", xlim=(1, r["max_layers"]), ylim=(bottom, 1.5))
        ax.axvline(math.log(r["n"]) / math.log(r["window"]), color="gray", ls="--", lw=1)
        ax.set_title(f"n={r['n']}, w={r['window']} (dashed: log_w n)", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("layers")
    for row in axes:
        row[0].set_ylabel("pairs not yet connected")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("Coverage against depth: fraction of (query, allowed key) pairs not yet connected\n"
                 "(median over seeds; ▼ every pair connected)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ints(name, text):
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name} is a comma list of integers like 16,64, got {text!r}")


def main():
    provenance()  # the commit and command each row records, fixed before the run
    try:
        if grid:
            specs = [r.partition(":") for r in grid_runs.split(",")]  # (setting, ":", kind)
            if not all(colon for _, colon, _ in specs):
                raise ValueError(f"--grid_runs is a comma list of setting:kind like causal:sa+swa, got {grid_runs!r}")
            runs = [(N, w, k, s) for w in ints("grid_window", grid_window) for N in ints("grid_n", grid_n)
                    for s, _, k in specs]
        else:
            runs = [(n, window, kind, setting)]
        for N, w, k, s in runs:
            check(N, w, k, s, heads, seeds, max_layers, sa_rule)
        for path in (json_out, plot):  # before the long run, not after it
            if path and path_problem(path, is_file=True):
                raise ValueError(f"{path}: {path_problem(path, is_file=True)}")
        if plot:
            pyplot("--plot")
        check_memory(max(N for N, *_ in runs))
    except ValueError as e:
        raise SystemExit(f"receptive_field.py: {e}")
    results = []
    for N, w, k, s in runs:
        results.append(measure(N, w, k, s, heads, seeds, max_layers, sa_rule))
        print(f"{s} {k} n={N} w={w}: {results[-1]['seconds']:.1f}s", file=sys.stderr, flush=True)
    print(table(results))
    if not grid:
        r = results[0]
        print("\nlayer  covered fraction  pairs not yet connected  (median over seeds)")
        print("\n".join(f"{i:5d}  {f:16.6f}  {round((1 - f) * r['pairs']):23d}" for i, f in enumerate(median_curve(r))))
    try:
        for path in (json_out, plot):
            if path and os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
        if json_out:
            with open(json_out, "w") as f:
                json.dump(dict(results=[dict(r, **provenance()) for r in results]), f)
        if plot:
            make_plot(results, plot)
    except OSError as e:  # a full disk
        raise SystemExit(f"receptive_field.py: cannot write {e.filename or json_out or plot}: {e.strerror or e} "
                         "(the table above is complete)")


if __name__ == "__main__":
    exec(open(os.path.join(ROOT, "configurator.py")).read())
    main()
