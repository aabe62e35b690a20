# The paper's pre-training setup, AS REPORTED in public summaries of the paper:
# ~360M parameters, 24 layers, d=1024, 16 heads, sequence length 2048, window 256,
# AdamW (0.9, 0.95), learning rate 3e-4. Everything else here (data, batch, token
# budget, schedule, weight decay) is NOT reported there and is our choice.
#   python prepare_data.py --dataset=fineweb-edu
#   torchrun --standalone --nproc_per_node=8 train.py config/paper_360m.py            # SA+SWA
#   torchrun --standalone --nproc_per_node=8 train.py config/paper_360m.py --attn=swa --out_dir=out-360m-swa
# 354M parameters with the GPT-2 vocabulary (50304 padded).
out_dir = "out-360m"
dataset = "fineweb-edu"
eval_interval = 1000
eval_iters = 100
log_interval = 10

# as reported
n_layer = 24
n_head = 16
n_embd = 1024
block_size = 2048
window = 256
attn = "sa+swa"
learning_rate = 3e-4
beta1 = 0.9
beta2 = 0.95

# our choices: ~0.5M tokens per iteration, 7.3B tokens (~20 per parameter)
batch_size = 8
gradient_accumulation_steps = 32   # 8 x 2048 x 32 = 524,288 tokens per iteration, over all ranks
max_iters = 14000
lr_decay_iters = 14000
warmup_iters = 700
min_lr = 3e-5
weight_decay = 0.1
grad_clip = 1.0
