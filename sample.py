"""
Read first. Sample from a checkpoint trained by train.py or from GPT-2; --attn swaps in another
kind, training-free (the paper's swap; not sa+swa, whose gates need training), and each attention
setting below changes the model's own:

  python sample.py --out_dir=out-quick
  python sample.py --out_dir=out-quick --start="def main(" --num_samples=3 --max_new_tokens=300
  python sample.py --out_dir=out-quick --start=FILE:prompt.txt --temperature=0.8 --top_k=50 --seed=1
  python sample.py --init_from=gpt2 --attn=sa --window=64 --start="The meaning of life is"
  python sample.py --init_from=gpt2 --attn=moba --moba_chunk=8 --start="The meaning of life is"

Text goes through the training data's tokenizer, whose meta.json the checkpoint carries. GPT-2's is
tiktoken's gpt2 (downloaded once, then cached), or for a GPT2LMHeadModel's directory the tokenizer
saved in it, if any. `python results/bench.py --generation=True` measures the speed with and
without the KV cache.
"""
import os
import sys
from dataclasses import fields

import torch

from attention import engine_line
from checkpoint import from_gpt2, gpt2_tokenizer, load_checkpoint
from guards import need
from kv_cache import use_kv_cache
from model import BUILT, DTYPES, GPTConfig, autocast
from prepare_data import get_tokenizer

# -----------------------------------------------------------------------------
init_from = "resume"  # "resume" (out_dir/ckpt.pt), "gpt2" ... "gpt2-xl", or a GPT-2 directory
out_dir = "out"  # where train.py wrote ckpt.pt
# the attention, each None: the model's own (a swap: model.swap_attention)
attn: str | None = None  # the kind to swap in: full, swa, sa or moba
window: int | None = None  # SWA's and SA's keys per query, itself included
moba_chunk: int | None = None  # MoBA's key chunk
moba_topk: int | None = None  # MoBA's chunks per query, its own included
sa_draw: str | None = None  # "layer": one SA draw per layer; "head": one per batch row and head
sa_rule: str | None = None  # "rank": SWA over permuted slots (the paper's); "value": r per token
# sampling
start = "\n"  # the prompt, or "FILE:path" to read it from a UTF-8 file
num_samples = 2  # independent samples
max_new_tokens = 500  # tokens generated per sample
temperature = 0.8  # < 1 sharpens the distribution, > 1 flattens it; 0: greedy (the likeliest token)
top_k = 200  # sample among the top_k most likely tokens; 0: among all
seed = 1337  # seeds the sampling and SA's draws (fresh at every forward pass)
use_cache = True  # decode from a KV cache where exact (not rank-rule SA); False: recompute prefixes
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
# a new kind's own GPTConfig field (a fork's) is a setting too, None: the model's own
for _field in fields(GPTConfig):
    if _field.name not in globals() and _field.name not in BUILT:  # BUILT: the shape, dropout, RoPE
        globals()[_field.name], __annotations__[_field.name] = None, _field.type | None
# -----------------------------------------------------------------------------
exec(open("configurator.py").read())  # overrides from config files and --key=value
# -----------------------------------------------------------------------------

if init_from == "resume":
    source = os.path.join(out_dir, "ckpt.pt")
    model, ckpt = load_checkpoint(source, device, require=("meta",))
    encode, decode = get_tokenizer(ckpt["meta"], source)  # the training data's tokenizer
else:  # GPT-2's weights (nanoGPT's from_pretrained) and BPE
    model = from_gpt2(init_from).to(device)
    encode, decode = gpt2_tokenizer(init_from)
# the attention settings given above, swapped in (one line where these weights cannot take them)
swap = {f.name: globals()[f.name] for f in fields(GPTConfig) if globals().get(f.name) is not None}
model.swap_attention(**swap)
if start.startswith("FILE:"):
    try:
        with open(start[5:], encoding="utf-8") as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"--start={start}: {getattr(e, 'strerror', None) or 'not UTF-8 text'}")
c = model.config
start_ids = encode(start)
need(start_ids and max(start_ids) < c.vocab_size, f"--start must encode to at least one token, "
     f"each < the model's vocab_size {c.vocab_size}")
# what runs the attention (on a GPU, the kernel's self-check runs now)
line = engine_line(device, DTYPES[dtype], c.n_embd // c.n_head, [c.attn], c.sa_rule)
print(line, file=sys.stderr)
use_cache = use_kv_cache(c, use_cache)  # warns once here, not once per sample

model.eval()
torch.manual_seed(seed)
model.seed_sa(seed)
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, :]  # (1, T)
with torch.no_grad(), autocast(device, dtype):
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None,
                           use_cache=use_cache)
        print(decode(y[0].tolist()))
        print("---------------")
