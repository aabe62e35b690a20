# Recall (MQAR): python prepare_data.py --dataset=mqar [--mqar_ordered=True --mqar_num_pairs=32 --mqar_num_queries=32],
# then python train.py config/mqar.py --attn=swa --out_dir=out-mqar-swa     (or full, sa, sa+swa, moba)
# 128-token sequences, key-value pairs first and queries in the second half, each at least
# min_gap tokens after its pair (49 in Zoology's layout with 8 pairs; exactly 63 when ordered);
# only the answers are scored, every eval reports their accuracy, and training draws fresh
# sequences every batch. SWA's reach is n_layer * (window - 1) = 14 tokens here, so it can only
# guess. Heads of 64 dimensions: with 16 (4 heads of d=64) a head cannot copy one of 128 values
# exactly, and the ordered control stalls at 0.55 (results/README.md, the search).
out_dir = "out-mqar"
dataset = "mqar"
device = "cpu"
dtype = "float32"
eval_interval = 100
eval_iters = 8
log_interval = 20

n_layer = 2
n_head = 2
n_embd = 128
block_size = 128     # the data's seq_len
attn = "sa+swa"
window = 8
moba_block = 2       # MoBA at the same key budget: moba_topk * moba_block = window
moba_topk = 4

batch_size = 32
gradient_accumulation_steps = 1
learning_rate = 3e-3
weight_decay = 0.0
max_iters = 300
warmup_iters = 50
min_lr = 3e-4
