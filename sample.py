"""
Sample from a checkpoint trained by train.py:

  python sample.py --out_dir=out-quick
  python sample.py --out_dir=out-quick --start="def main(" --num_samples=3 --max_new_tokens=300
  python sample.py --out_dir=out-quick --start=FILE:prompt.txt --temperature=0.8 --top_k=50 --seed=1

Text is encoded and decoded with the tokenizer the training data was prepared
with (its meta.json, which the checkpoint carries). SA draws fresh permutations
at every forward pass; --seed fixes them, together with the sampling itself.

Which models decode from the KV cache (kv_cache.py, exact, one token per step): full, swa, moba,
and sa or sa+swa with sa_rule="value". Rank-rule sa and sa+swa (the paper's rule, and the
README's out-quick model) cannot be cached exactly, so every token recomputes the whole prefix;
sample.py says so once. Speed with and without the cache: bench.benchmark_generation.
"""
import os
import sys

import torch

from attention import engine
from checkpoint import check_device, load_checkpoint
from model import DTYPES, autocast
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
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
# -----------------------------------------------------------------------------
exec(open("configurator.py").read())
# -----------------------------------------------------------------------------

# each bad setting stops here, with one line, before any model is loaded
for bad, message in [(not temperature >= 0, f"temperature={temperature}: use a value > 0, or 0 for greedy decoding"),
                     (top_k < 0, f"top_k={top_k}: use a value >= 1, or 0 to sample among all tokens"),
                     (max_new_tokens < 0 or num_samples < 1, f"max_new_tokens={max_new_tokens}, num_samples="
                      f"{num_samples}: use max_new_tokens >= 0, num_samples >= 1")]:
    if bad:
        sys.exit(message)
try:
    check_device(device, dtype)
except ValueError as e:
    sys.exit(str(e))
prompt = start
if start.startswith("FILE:"):
    try:
        with open(start[len("FILE:"):], encoding="utf-8") as f:
            prompt = f.read()
    except OSError as e:
        sys.exit(f"--start={start}: {e.strerror}")
    except UnicodeDecodeError:
        sys.exit(f"--start={start} is not UTF-8 text")
try:
    ctx = autocast(device, dtype)
    model, ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"), device, need=("meta",))  # meta: its tokenizer
except ValueError as e:
    sys.exit(str(e))
encode, decode = get_tokenizer(ckpt["meta"])  # the training data's tokenizer
try:
    start_ids = encode(prompt)
except ValueError as e:
    sys.exit(f"--start: {e}")
if not start_ids or max(start_ids) >= model.config.vocab_size:
    sys.exit(f"--start must encode to at least one token, each < the model's vocab_size {model.config.vocab_size}")
cached = use_cache and model.config.cacheable
if use_cache and not cached:
    print(f"attn={model.config.attn!r} with sa_rule='rank' cannot be decoded from a KV cache exactly: "
          "every token recomputes the whole prefix", file=sys.stderr)

c = model.config  # the line saying what runs the attention (on a GPU: the kernel's self-check)
print(engine(device, DTYPES[dtype], c.n_embd // c.n_head, [c.attn], c.sa_rule), file=sys.stderr)
model.eval()
torch.manual_seed(seed)
model.seed_sa(seed)
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, :]  # (1, T)
with ctx:
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, use_cache=cached)
        print(decode(y[0].tolist()))
        print("---------------")
