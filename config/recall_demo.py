# The class demo: recall beyond SWA's reach, within SA+SWA's coverage (python results/reproduce.py --only=demo).
# 64-token sequences, one key-value pair, its key asked once in the second half: every answer is >= 30 tokens back,
# where SWA's 3 x (8 - 1) = 21 cannot reach, while SA+SWA's permuted windows reach it (results/README.md, the demo).
# Prepare its data: python prepare_data.py --dataset=mqar --mqar_num_pairs=1 --mqar_num_queries=1 --mqar_offset=1
out_dir = "out-recall-demo"
dataset = "mqar"
device = "cpu"
dtype = "float32"
eval_interval = 300
eval_iters = 8
log_interval = 100

n_layer = 3
n_head = 4
n_embd = 64
block_size = 64
attn = "sa+swa"
window = 8
sa_perm = "head"

batch_size = 32
gradient_accumulation_steps = 1
learning_rate = 3e-4
beta2 = 0.999
weight_decay = 0.01
grad_clip = 0.0
warmup_iters = 200
min_lr = 0.0
max_iters = 3000
lr_decay_iters = 3000
