# The training loop in 2.5 minutes on a 2-core CPU, not SA's effect (at T=256 SWA alone does better; for SA, see
# config/recall_demo.py): a small SA+SWA model on the embedded pystdlib data (python prepare_data.py first). The val
# loss starts at 5.36 nats per byte (chance, a uniform guess, is ln 256 = 5.55) and ends at 1.75.
# python train.py config/quick.py
out_dir = "out-quick"
dataset = "pystdlib"
device = "cpu"
dtype = "float32"
eval_interval = 100
eval_iters = 10
log_interval = 10

n_layer = 4
n_head = 4
n_embd = 128
block_size = 256
attn = "sa+swa"
window = 32

batch_size = 8
gradient_accumulation_steps = 1
learning_rate = 2e-3
max_iters = 500
lr_decay_iters = 500
warmup_iters = 20
min_lr = 2e-4
