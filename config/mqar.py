# Multi-query associative recall: python prepare_data.py --dataset=mqar, then
#   python train.py config/mqar.py --attn=swa --out_dir=out-mqar-swa     (or full, sa, sa+swa, moba)
# Each 256-token sequence puts 8 key-value pairs first and queries all 8 keys at
# least min_gap = 225 tokens later; only the answers are scored, and every eval
# reports their accuracy. SWA's reach is n_layer * (window - 1) = 62 tokens here, so
# it can only guess (1/64); a value that occurs in the sequence would be right 1/8
# of the time, so accuracy well above 0.125 means real recall.
out_dir = "out-mqar"
dataset = "mqar"
device = "cpu"
dtype = "float32"
eval_interval = 100
eval_iters = 10
log_interval = 20

n_layer = 2
n_head = 4
n_embd = 128
block_size = 256     # the data's seq_len
attn = "sa+swa"
window = 32

batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 1e-3
weight_decay = 0.0
max_iters = 1500
warmup_iters = 50
min_lr = 1e-4
