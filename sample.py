"""
Sample from a checkpoint trained by train.py:

  python sample.py --out_dir=out-quick
  python sample.py --out_dir=out-quick --start="def main(" --num_samples=3 --max_new_tokens=300
  python sample.py --out_dir=out-quick --start=FILE:prompt.txt --temperature=0.8 --top_k=50 --seed=1

Text is encoded and decoded with the tokenizer the training data was prepared
with (its meta.json, which the checkpoint carries). SA draws fresh permutations
at every forward pass; --seed fixes them, together with the sampling itself.
"""
import os
import sys

import torch

from model import autocast, load_checkpoint
from prepare_data import get_tokenizer

# -----------------------------------------------------------------------------
out_dir = "out"          # where train.py wrote ckpt.pt
start = "\n"             # the prompt, or "FILE:path" to read it (UTF-8 text) from a file
num_samples = 2          # independent samples
max_new_tokens = 500     # tokens generated per sample
temperature = 0.8        # < 1 sharpens the distribution, > 1 flattens it; 0: greedy (always the most likely token)
top_k = 200              # sample among the top_k most likely tokens; 0: among all
seed = 1337              # seeds the sampling and the SA permutations
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
# -----------------------------------------------------------------------------
exec(open("configurator.py").read())
# -----------------------------------------------------------------------------
if temperature < 0:
    sys.exit(f"temperature={temperature}: use a value > 0, or 0 for greedy decoding")
if top_k < 0:
    sys.exit(f"top_k={top_k}: use a value >= 1, or 0 to sample among all tokens")
if max_new_tokens < 0 or num_samples < 1:
    sys.exit(f"max_new_tokens={max_new_tokens}, num_samples={num_samples}: use max_new_tokens >= 0, num_samples >= 1")
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"device={device}, but CUDA is not available here: use --device=cpu")
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
try:
    ctx = autocast(device, dtype)
except ValueError as e:
    sys.exit(str(e))

x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, :]  # (1, T)
with ctx:
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None)
        print(decode(y[0].tolist()))
        print("---------------")
