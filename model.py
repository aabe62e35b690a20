"""
Read first. nanoGPT's GPT with a switchable attention: GPTConfig.attn picks every layer's kind,
"full", "swa", "sa" (SWA over a fresh random permutation per layer and forward), "sa+swa" (the
paper's gated dual path) or "moba" (the baseline). CausalSelfAttention.attend calls each kind's
function in attention.py.
"""
import math
import numbers
import operator
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from typing import List

import torch
import torch.nn as nn
from torch.nn import functional as F

import attention
from guards import InputError, check_tokens, checked, need
from kv_cache import KVCache, cacheable, use_kv_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# GPTConfig.attn's kinds. A new one: its function in attention.py, its name here and its branch in
# CausalSelfAttention.attend, and a GPTConfig field for a setting of its own
ATTNS = ("full", "swa", "sa", "sa+swa", "moba")


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx  # layer_idx: its place in a KVCache
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.attn == "sa+swa":  # a gate per head for each path, read from the layer's input
            self.gate = nn.Linear(config.n_embd, 2 * config.n_head, bias=False)

    def forward(self, x, rope=None, draw=None, cache=None):
        """x (B, T, C) -> (B, T, C). rope: (cos, sin) of the T positions; draw: this layer's SA
        draw; cache: generate's KV cache, which this layer fills (and a decoding step reads)."""
        B, T, C = x.size()
        nh = self.config.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)  # (B, nh, T, hs)
        if rope is not None:  # by true positions, before SA permutes (the paper)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            cache.store(self.layer_idx, k, v, draw)
        if self.config.attn == "sa+swa":  # the paper's gated dual path
            g = torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)  # (B, 2 * nh, T, 1)
            g_sa, g_swa = g[:, :nh], g[:, nh:]  # (B, nh, T, 1) each: per token, head and path
            y_sa = self.attend("sa", q, k, v, draw, cache)
            y_swa = self.attend("swa", q, k, v, None, cache)
            y = g_sa * y_sa + g_swa * y_swa  # Y = sigmoid(x W_sa) * Y_sa + sigmoid(x W_swa) * Y_swa
        else:
            y = self.attend(self.config.attn, q, k, v, draw, cache)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, kind, q, k, v, draw, cache=None):
        """q, k, v (B, nh, T, hs) -> y (B, nh, T, hs) by attention `kind`, with its settings."""
        c = self.config
        if cache is not None and cache.start > 0:  # decoding: the new query over the KV cache
            return cache.attend(self.layer_idx, q, kind)
        if kind == "full":
            return attention.full_attention(q, k, v)
        if kind == "swa":
            return attention.sliding_window_attention(q, k, v, c.window)
        if kind == "sa" and c.sa_rule == "rank":  # draw: a permutation of the T positions
            return attention.stochastic_attention(q, k, v, c.window, draw)
        if kind == "sa":  # the value rule; draw: a number r per token
            return attention.stochastic_value_attention(q, k, v, c.sa_delta, draw)
        if kind == "moba":
            return attention.moba_attention(q, k, v, c.moba_chunk, c.moba_topk)
        raise InputError(f"attn={kind!r} has no branch in CausalSelfAttention.attend")


class Block(nn.Module):
    """GPT-2's pre-LayerNorm transformer block."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        C = config.n_embd
        self.ln_1 = nn.LayerNorm(C, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(C, bias=config.bias)
        self.mlp = nn.Sequential(OrderedDict(  # GPT-2's MLP, its names
            c_fc=nn.Linear(C, 4 * C, bias=config.bias), gelu=nn.GELU(approximate="tanh"),
            c_proj=nn.Linear(4 * C, C, bias=config.bias), dropout=nn.Dropout(config.dropout)))

    def forward(self, x, rope=None, draw=None, cache=None):
        x = x + self.attn(self.ln_1(x), rope, draw, cache)
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    # GPT-2 small's shape (124M) with SA+SWA. Each field is also a train.py setting.
    block_size: int = 1024  # maximum sequence length
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # residual and embedding dropout
    bias: bool = False  # biases in Linears and LayerNorms (GPT-2 has them)
    attn: str = "sa+swa"  # the attention: one of ATTNS
    window: int = 256  # SWA's keys per query, itself included; SA's on average, at block_size
    moba_chunk: int = 64  # MoBA's key chunk (its paper's "block")
    moba_topk: int = 4  # MoBA's chunks per query, its own included
    sa_draw: str = "layer"  # "layer": one SA draw per layer (the paper's); "head": per row and head
    sa_rule: str = "rank"  # "rank": SWA over permuted slots (the paper's); "value": r per token
    pos_emb: str = "rope"  # "rope" or "learned" (GPT-2's, to load its weights)
    rope_base: float = 10000.0

    def __post_init__(self):  # every model's door: each field checked, a bad one named in one line
        # each integer field (a new kind's too) an integer >= 1, each float field a number
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int:
                ok = hasattr(value, "__index__") and not isinstance(value, bool)
                ok = ok and operator.index(value) >= 1
                need(ok, f"GPTConfig.{f.name}={value!r} is invalid: must be an integer >= 1")
                setattr(self, f.name, operator.index(value))  # numpy's integers too
            if f.type is float:
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
                need(ok, f"GPTConfig.{f.name}={value!r} is invalid: must be a number")
                setattr(self, f.name, float(value))
        need(0 <= self.dropout < 1,  # NaN fails too
             f"GPTConfig.dropout={self.dropout!r} is invalid: must be in [0, 1)")
        need(1 < self.rope_base < math.inf,
             f"GPTConfig.rope_base={self.rope_base!r} is invalid: must be a number > 1 (10000 is usual)")
        choices = {"attn": ATTNS, "sa_draw": ("layer", "head"), "sa_rule": ("rank", "value"),
                   "pos_emb": ("rope", "learned"), "bias": (True, False)}
        for name, allowed in choices.items():
            value = getattr(self, name)
            need(value in allowed and type(value) is type(allowed[0]),
                 f"GPTConfig.{name}={value!r} is invalid: must be one of {allowed}")
        need(self.n_embd % self.n_head == 0,
             f"GPTConfig.n_embd={self.n_embd} is invalid: must be divisible by n_head={self.n_head}")
        need(self.pos_emb != "rope" or self.n_embd // self.n_head % 2 == 0,
             f"GPTConfig.n_embd={self.n_embd} is invalid: RoPE needs an even head size n_embd // n_head")

    @property
    def sa_delta(self):
        """The value rule's width: a pair meets with probability 2 * delta - delta**2, about the
        rank rule's at T = block_size; a query sees 1 + (T - 1) * (delta - delta**2 / 2) keys on
        average."""
        return self.window / self.block_size

    @property
    def cacheable(self):
        """Whether GPT.generate can decode from an exact KV cache (kv_cache.cacheable): not
        rank-rule SA, where whether query i sees key j depends on later tokens' slots."""
        return cacheable(self)


class GPT(nn.Module):

    def __init__(self, config, sa_seed=0):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # RoPE's angles
            hs = config.n_embd // config.n_head
            inv_freq = 1.0 / config.rope_base ** (torch.arange(0, hs, 2).float() / hs)  # (hs/2,)
            positions = torch.arange(config.block_size).float()  # (block_size,)
            angles = torch.outer(positions, inv_freq)  # (block_size, hs/2)
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # SA's own random generator, on the CPU (the same draws on any device). Its state is kept in
        # a tensor, which checkpoints save: sa_draw makes a torch.Generator of it, then stores its state
        self.sa_state = torch.Generator().manual_seed(sa_seed).get_state()  # (5056,) uint8
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            if name.endswith("gate.weight"):  # both gates start at sigmoid(0) = 0.5
                nn.init.zeros_(p)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, cache=None, draws=None):
        """idx (B, T) -> logits (B, T, vocab), and the loss if targets (-1: ignored). cache:
        generate's KV cache, which idx continues; draws: one SA draw per layer, instead of fresh
        ones."""
        check_tokens(idx, self.config, targets, cache, draws)
        B, T = idx.size()
        c = self.config
        start = 0 if cache is None else cache.start  # idx[:, 0]'s position
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if c.pos_emb == "learned":
            pos = torch.arange(start, start + T, device=idx.device)  # (T,)
            x = x + self.transformer.wpe(pos)  # (B, T, C)
        else:
            rope = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, hs/2) each
        x = self.transformer.drop(x)
        # SA's draw, fresh per layer and forward: a random permutation of the T positions, or a
        # number r per token (the value rule); (T,), or with sa_draw="head" one per row and head
        shape = [T] if c.sa_draw == "layer" else [B, c.n_head, T]
        draw = None
        for i, block in enumerate(self.transformer.h):
            if draws is not None:
                draw = draws[i]
            elif c.attn in ("sa", "sa+swa"):
                draw_fn = sa_draw_op if torch.compiler.is_compiling() else sa_draw  # op: for compile
                draw = draw_fn(self.sa_state, shape, c.sa_rule == "value", idx.device)
            x = block(x, rope, draw, cache)
        if cache is not None:
            cache.start += T
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            logits_2d = logits.view(-1, logits.size(-1)).float()  # (B * T, vocab), fp32
            loss = F.cross_entropy(logits_2d, targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def seed_sa(self, seed):
        """Restart SA's draws from seed."""
        ok = hasattr(seed, "__index__") and not isinstance(seed, bool) and -2**63 <= seed < 2**64
        need(ok, f"seed must be an integer that fits in 64 bits, got {seed!r}")
        self.sa_state.copy_(torch.Generator().manual_seed(operator.index(seed)).get_state())

    def swap_attention(self, **changes):
        """Training-free swap: these weights with another kind or its settings (see swapped)."""
        self.config = swapped(self.config, **changes)
        for block in self.transformer.h:
            block.attn.config = self.config
        return self

    def crop_block_size(self, block_size):
        """nanoGPT's (its from_pretrained is checkpoint.from_gpt2): a loaded model's context cut to
        block_size; value-rule SA's sa_delta = window / block_size grows by the same factor."""
        need(block_size <= self.config.block_size,
             f"block_size={block_size}: the model holds at most {self.config.block_size} positions")
        self.config = replace(self.config, block_size=block_size)
        for block in self.transformer.h:
            block.attn.config = self.config
        if self.config.pos_emb == "learned":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        else:
            self.rope_cos, self.rope_sin = self.rope_cos[:block_size], self.rope_sin[:block_size]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matmul weights and embeddings
        no_decay = [p for p in params if p.dim() < 2]  # biases and LayerNorm gains
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = dict(fused=True) if device_type == "cuda" else {}  # every torch of requirements.txt
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **fused)

    def flops_per_token(self, T):
        """Training FLOPs per token at sequence length T (nanoGPT's count): 6 per weight, plus
        12 * n_layer * n_embd per key a query sees (keys_seen); None for a kind not counted."""
        c, keys = self.config, keys_seen(self.config, T)
        if keys is None:
            return None
        return 6 * self.get_num_params() + 12 * c.n_layer * c.n_embd * keys

    def estimate_mfu(self, tokens_per_iter, dt, T, peak_flops=312e12):
        """Model FLOPs utilisation against an A100's bf16 peak (None where flops_per_token is)."""
        flops = self.flops_per_token(T)
        return None if flops is None else flops * tokens_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Append max_new_tokens sampled tokens to idx (B, T); temperature=0: greedy. use_cache:
        decode from a KVCache where the model allows, refilled from the last block_size // 2 tokens
        when full; else each step recomputes the last block_size tokens (nanoGPT)."""
        c = self.config
        check_tokens(idx, c, sampling=(max_new_tokens, temperature, top_k))
        use_cache = use_kv_cache(c, use_cache)
        cache = None
        for _ in range(max_new_tokens):
            if use_cache and (cache is None or cache.start == c.block_size):  # prompt, or refill
                keep = c.block_size if cache is None else max(1, c.block_size // 2)
                cache = KVCache(c)
                logits, _ = self(idx[:, -keep:], cache=cache)
            else:
                logits, _ = self(idx[:, -1:] if use_cache else idx[:, -c.block_size:], cache=cache)
            logits = logits[:, -1, :].double()  # (B, vocab), whatever the autocast
            if temperature == 0:
                idx_next = logits.argmax(-1, keepdim=True)  # (B, 1)
            else:  # max subtracted first: a tiny temperature gives 0 and -inf, never inf - inf
                logits = (logits - logits.max(-1, keepdim=True).values) / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    def model_args(self):
        return asdict(self.config)


def sa_draw(state: torch.Tensor, shape: List[int], value: bool, device: torch.device) -> torch.Tensor:
    """SA's draw of the given shape, (T,) or (B, nh, T), on device: a random permutation of range(T)
    in each row, or (value) numbers r in [0, 1), from the CPU generator whose state is `state`,
    advanced in place. Marked as checked: attention.py need not read it back from a GPU."""
    g = torch.Generator().set_state(state)
    if value:
        draw = torch.rand(shape, generator=g)
    elif len(shape) == 1:
        draw = torch.randperm(shape[0], generator=g)
    else:
        draw = torch.rand(shape, generator=g).argsort(-1)  # a permutation per row
    state.copy_(g.get_state())
    if device.type == "cuda":  # from pinned memory, the copy below does not wait for the GPU
        draw = draw.pin_memory()
    return checked(draw.to(device, non_blocking=True))


# -----------------------------------------------------------------------------
# Support, which a first reading skips: RoPE, the FLOP count, the draw as an op, swaps, autocast.

def apply_rope(x, cos, sin):
    """x (B, nh, T, hs) rotated by its T positions' angles, cos and sin (T, hs/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).type_as(x)  # (B, nh, T, hs)


def keys_seen(config, T):
    """The keys a query of config's kind sees at sequence length T, on average over the T queries
    (itself included); None for a kind not counted here."""
    c = config
    w = min(c.window, T)
    band = w * (2 * T - w + 1) / (2 * T)  # SWA's min(i + 1, w), on average; the rank rule's too
    d = c.sa_delta
    value = 1 + (T - 1) * (d - d ** 2 / 2)  # itself, and each earlier key w.p. 2 d - d^2
    sa = value if c.sa_rule == "value" else band
    if c.attn == "full":
        return (T + 1) / 2
    if c.attn == "swa":
        return band
    if c.attn == "sa":
        return sa
    if c.attn == "sa+swa":
        return band + sa
    if c.attn == "moba":  # its own chunk up to itself, and up to moba_topk - 1 whole past chunks
        m = min(c.moba_chunk, T)
        return sum(i % m + 1 + min(c.moba_topk - 1, i // m) * m for i in range(T)) / T
    return None


# torch.compile cannot trace a torch.Generator: it calls sa_draw as this op, whose body it skips
sa_draw_op = torch.library.custom_op("sa::draw", sa_draw, mutates_args=("state",))
sa_draw_op.register_fake(lambda state, shape, value, device: torch.empty(
    shape, dtype=torch.float if value else torch.long, device=device))


# GPTConfig's fields fixed when the weights are built; every other field (attn, window, moba_chunk,
# moba_topk, sa_draw, sa_rule, a new kind's own) is the attention's, which a swap may change
BUILT = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "pos_emb", "rope_base")


def swapped(config, **changes):
    """config with changes (GPT.swap_attention) to the attention's fields (not BUILT's); an
    InputError where the weights cannot swap."""
    other = sorted(set(changes) & set(BUILT) | set(changes) - set(asdict(config)))
    attention_fields = ", ".join(f.name for f in fields(config) if f.name not in BUILT)
    need(not other, f"swap_attention changes the attention ({attention_fields}), not {', '.join(other)}")
    new = replace(config, **changes)
    need((new.attn == "sa+swa") == (config.attn == "sa+swa"),
         f"cannot swap attn={config.attn!r} -> {new.attn!r} without training: the gates of sa+swa are "
         "learned with both paths (a swap may change its window)")
    return new


def autocast(device, dtype):
    """The scripts' mixed precision."""
    need(dtype in DTYPES, f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device.split(":")[0], dtype=DTYPES[dtype])
