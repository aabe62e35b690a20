# The class demo: recall beyond SWA's reach, within SA+SWA's coverage (python results/reproduce.py --only=demo).
# 64-token sequences, one cue-value pair, its cue asked once in the second half: every answer is >= 30 tokens back,
# beyond SWA's reach of 3 x (10 - 1) = 27, while SA+SWA's permuted windows reach it (results/README.md, the demo).
# Prepare its data: python prepare_data.py --dataset=mqar --mqar_num_pairs=1 --mqar_num_queries=1 --mqar_offset=1
#   --mqar_vocab=32 --data_root=data-demo   (results/reproduce.py --only=demo does it for you)
# Found by a search of about 1.5 CPU-hours, its 5 seeds included (git show 6c696ec:results/README.md lists the tries).
out_dir = "out-recall-demo"
dataset = "mqar"
data_root = "data-demo"
device = "cpu"
dtype = "float32"
eval_interval = 100
eval_iters = 8
log_interval = 100

n_layer = 3
n_head = 4
n_embd = 64
block_size = 64
attn = "sa+swa"
window = 10
sa_draw = "head"  # one permutation per (row, head): 4 per row and layer

batch_size = 32
gradient_accumulation_steps = 1
learning_rate = 3e-3
beta2 = 0.999
weight_decay = 0.01
grad_clip = 0.0
warmup_iters = 50
min_lr = 0.0
max_iters = 1500
lr_decay_iters = 1500
