"""
Sample from a checkpoint trained by train.py:

  python sample.py --out_dir=out-quick
  python sample.py --out_dir=out-quick --start="def main(" --num_samples=3 --max_new_tokens=300
  python sample.py --out_dir=out-quick --start=FILE:prompt.txt --temperature=0.8 --top_k=50 --seed=1
  python sample.py --benchmark=True     # generation speed per attention kind, with and without the KV cache

Text is encoded and decoded with the tokenizer the training data was prepared
with (its meta.json, which the checkpoint carries). SA draws fresh permutations
at every forward pass; --seed fixes them, together with the sampling itself.
Generation decodes from a KV cache where that is exact (every kind but rank-rule SA: see
GPT.generate); rank-rule sa and sa+swa recompute the whole prefix for every token.
"""
import os
import statistics
import sys
import time

import torch

from model import ATTN_KINDS, GPT, GPTConfig, autocast, load_checkpoint
from prepare_data import get_tokenizer

# -----------------------------------------------------------------------------
out_dir = "out"          # where train.py wrote ckpt.pt
start = "\n"             # the prompt, or "FILE:path" to read it (UTF-8 text) from a file
num_samples = 2          # independent samples
max_new_tokens = 500     # tokens generated per sample
temperature = 0.8        # < 1 sharpens the distribution, > 1 flattens it; 0: greedy (always the most likely token)
top_k = 200              # sample among the top_k most likely tokens; 0: among all
seed = 1337              # seeds the sampling and the SA permutations
use_cache = True         # decode from a KV cache where it is exact (not rank-rule SA); False: recompute the prefix
benchmark = False        # True: print the speed table of benchmark_generation() below (no checkpoint needed) and exit
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
# -----------------------------------------------------------------------------
exec(open("configurator.py").read())
# -----------------------------------------------------------------------------


def benchmark_generation(lengths=(256, 1024, 4096), new_tokens=(5, 33), vocab_size=512):
    """ms per generated token, for every attention kind, with and without the KV cache, after
    prompts of each length, on a small random model built here. A step is timed from the end of
    one forward of generate to the end of the next (a forward hook), so the prompt's prefill is
    left out; the median step, to shrug off other processes. new_tokens[use_cache] steps each."""
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


if benchmark:
    benchmark_generation()
    sys.exit()
if temperature < 0:
    sys.exit(f"temperature={temperature}: use a value > 0, or 0 for greedy decoding")
if top_k < 0:
    sys.exit(f"top_k={top_k}: use a value >= 1, or 0 to sample among all tokens")
if max_new_tokens < 0 or num_samples < 1:
    sys.exit(f"max_new_tokens={max_new_tokens}, num_samples={num_samples}: use max_new_tokens >= 0, num_samples >= 1")
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"device={device}, but CUDA is not available here: use --device=cpu")
try:
    ctx = autocast(device, dtype)
except ValueError as e:
    sys.exit(str(e))
if start.startswith("FILE:"):
    path = start[len("FILE:"):]
    try:
        with open(path, encoding="utf-8") as f:
            start = f.read()
    except OSError as e:
        sys.exit(f"--start=FILE:{path}: {e.strerror}")
    except UnicodeDecodeError:
        sys.exit(f"--start=FILE:{path} is not UTF-8 text")

try:
    model, ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"), device)
    if "meta" not in ckpt:
        raise ValueError(f"{out_dir}/ckpt.pt carries no meta.json, so its tokenizer is unknown: "
                         "re-save it with this repo's train.py")
    encode, decode = get_tokenizer(ckpt["meta"])  # the training data's tokenizer
    start_ids = encode(start)
except ValueError as e:
    sys.exit(str(e))
model.eval()
if not start_ids:
    sys.exit("--start encodes to no tokens: give at least one character")
if max(start_ids) >= model.config.vocab_size:
    sys.exit(f"--start holds token ids >= the model's vocab_size {model.config.vocab_size}")
torch.manual_seed(seed)
model.sa_generator.manual_seed(seed)

x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, :]  # (1, T)
with ctx:
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, use_cache=use_cache)
        print(decode(y[0].tolist()))
        print("---------------")
