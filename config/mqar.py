# Recall (MQAR) at 2 layers, BELOW SA+SWA's coverage: SA+SWA fails here as SWA does (see config/recall_demo.py).
# Data: python prepare_data.py --dataset=mqar   (its mqar defaults are this recipe's data),
# then python train.py config/mqar.py --attn=swa --out_dir=out-mqar-swa     (or full, sa, sa+swa, moba)
# 64-token sequences: 4 cue-value pairs first, then 4 queries at random positions of the second
# half, each at least min_gap = 25 tokens after its pair; the answer is found by content (which
# earlier cue equals mine). Only the answers are scored, every eval reports their accuracy, and
# training makes fresh sequences every batch. SWA's reach is n_layer * (window - 1) = 6 tokens
# here, so it can only guess. The learning rate is what makes full attention learn it: with
# model.py's init (GPT-2's: N(0, 0.02), residual projections scaled down) it stays on the
# "one of the 4 values" plateau at lr 1e-3 or more; at 1e-4 it leaves it after 2,000 to 8,000
# iterations, depending on the seed (results/mqar_search.json, mqar_probes.json).
out_dir = "out-mqar"
dataset = "mqar"
device = "cpu"
dtype = "float32"
eval_interval = 1000
eval_iters = 8
log_interval = 100

n_layer = 2
n_head = 1           # one head of 64 dimensions
n_embd = 64
block_size = 64      # the data's seq_len
attn = "sa+swa"
window = 4
moba_chunk = 2       # MoBA at the same key budget: moba_topk * moba_chunk = window
moba_topk = 2

batch_size = 32
gradient_accumulation_steps = 1
learning_rate = 1e-4
decay_lr = False     # constant: the circuit forms late, a decayed lr would slow it
weight_decay = 0.0
max_iters = 12000
lr_decay_iters = 12000
