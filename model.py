"""Read first. nanoGPT's GPT with switchable attention: GPTConfig.attn picks every layer's kind from KINDS: "full",
"swa", "sa" (SWA over a fresh random permutation per layer and forward), "sa+swa" (the paper's gated dual path) or
"moba" (the baseline). GPT.generate decodes from a KV cache where the kind and sa_rule allow (GPTConfig.cacheable).
"""
import math
import numbers
import operator
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

import attention
from guards import InputError, check_tokens, checked, need, setting_problem
from kv_cache import LAYOUTS, KVCache, use_kv_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalSelfAttention(nn.Module):
    """Causal self-attention of kind config.attn; "sa+swa" (the paper's best) runs SA and SWA on one q, k, v, gated
    per token, head and path: Y = sigmoid(x W_sa) Y_sa + sigmoid(x W_swa) Y_swa."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx  # layer_idx: its place in a KVCache
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.attn == "sa+swa":  # the gates read ln_1(x)
            self.gate = nn.Linear(config.n_embd, 2 * config.n_head, bias=False)

    def forward(self, x, draw=None, rope=None, cache=None):
        """x (B, T, C) -> (B, T, C). draw: this layer's SA draw; rope: (cos, sin) of the T positions; cache: a KVCache
        to fill (attend reads it)."""
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
        if self.config.attn == "sa+swa":
            g = torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)  # (B, 2*nh, T, 1)
            y_sa, y_swa = self.attend("sa", q, k, v, draw, cache), self.attend("swa", q, k, v, None, cache)
            y = g[:, :nh] * y_sa + g[:, nh:] * y_swa
        else:
            y = self.attend(self.config.attn, q, k, v, draw, cache)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, kind, q, k, v, draw, cache=None):
        """q, k, v (B, nh, T, hs) -> (B, nh, T, hs) by kind's KINDS row; a decode step reads the KV cache instead."""
        row = KINDS[kind]
        args = [draw if a == "draw" else getattr(self.config, a) for a in row.args]
        if cache is not None and cache.start > 0:
            return cache.attend(self.layer_idx, q, kind, row.fn, args)
        return row.fn(q, k, v, *args)


class Layer(nn.Module):
    """GPT-2's pre-LayerNorm layer."""

    def __init__(self, config, layer_idx=0):
        super().__init__()
        C = config.n_embd
        self.ln_1 = nn.LayerNorm(C, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(C, bias=config.bias)
        self.mlp = nn.Sequential(OrderedDict(  # GPT-2's MLP, its names
            c_fc=nn.Linear(C, 4 * C, bias=config.bias), gelu=nn.GELU(approximate="tanh"),
            c_proj=nn.Linear(4 * C, C, bias=config.bias), dropout=nn.Dropout(config.dropout)))

    def forward(self, x, draw=None, rope=None, cache=None):
        x = x + self.attn(self.ln_1(x), draw, rope, cache)
        return x + self.mlp(self.ln_2(x))


class Kind(NamedTuple):
    """All the repo reads of an attention kind."""
    fn: Optional[Callable]  # (q, k, v, *args) -> y; None: sa+swa, composed by the layer
    args: tuple  # fn's args after q, k, v: GPTConfig fields or properties, or "draw" (the layer's SA draw)
    settings: dict  # {each GPTConfig field it reads: its choices or range}: GPTConfig checks them, swaps set them
    keys_seen: Callable  # (config, T) -> how many keys a query sees (flops_per_token)
    kv_layout: Callable  # config -> its KV-cache layout, a kv_cache.LAYOUTS key, or None: no cache
    draws: bool = False  # whether it takes SA's draws (GPT.draw_sa)


def sa_by_rule(q, k, v, window, sa_rule, sa_delta, draw):
    if sa_rule == "value":
        return attention.stochastic_value_attention(q, k, v, sa_delta, draw)
    return attention.stochastic_attention(q, k, v, window, draw)


POSITIVE = range(1, 2**63)  # an integer >= 1
SA = {"window": POSITIVE, "sa_draw": ("layer", "head"), "sa_rule": ("rank", "value")}
# Every kind. A new one: its function, a row here, a GPTConfig field per setting of its own (README's "Add a kind").
KINDS = {
    "full": Kind(attention.full_attention, (), {}, lambda c, T: (T + 1) / 2, lambda c: "all"),
    "swa": Kind(attention.sliding_window_attention, ("window",), {"window": POSITIVE}, lambda c, T: min(c.window, T),
                lambda c: "window"),
    "sa": Kind(sa_by_rule, ("window", "sa_rule", "sa_delta", "draw"), SA, lambda c, T: min(c.window, T),
               lambda c: "sorted" if c.sa_rule == "value" else None, draws=True),
    "sa+swa": Kind(None, (), SA, lambda c, T: 2 * min(c.window, T),
                   lambda c: "sorted" if c.sa_rule == "value" else None, draws=True),
    "moba": Kind(attention.moba_attention, ("moba_chunk", "moba_topk"), {"moba_chunk": POSITIVE, "moba_topk": POSITIVE},
                 lambda c, T: min(c.moba_chunk * c.moba_topk, T), lambda c: "chunks"),
}


@dataclass
class GPTConfig:
    # GPT-2 small's shape (124M) with SA+SWA. Each field is a train.py setting.
    block_size: int = 1024  # maximum sequence length
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # residual and embedding dropout
    bias: bool = False  # biases in Linears and LayerNorms (GPT-2 has them)
    attn: str = "sa+swa"  # a kind of KINDS
    window: int = 256  # SWA/SA keys per query, itself included (value-rule SA: at T = block_size)
    moba_chunk: int = 64  # MoBA's key chunk (its paper's "block")
    moba_topk: int = 4  # MoBA's chunks per query, its own included
    sa_draw: str = "layer"  # "layer": one SA draw per layer (the paper); "head": one per layer, row and head
    sa_rule: str = "rank"  # "rank": windows over permuted slots (the paper); "value": a number r per token
    pos_emb: str = "rope"  # "rope" or "learned" (GPT-2's, to load its weights)
    rope_base: float = 10000.0

    def __post_init__(self):  # every model's door: each field checked (guards.SETTINGS, its values), its KV layout
        allowed = dict(attn=tuple(KINDS), pos_emb=("rope", "learned"), bias=(True, False))
        for row in KINDS.values():
            allowed.update(row.settings)  # rows that share a setting give it the same values
        for f in fields(self):
            value = getattr(self, f.name)
            int_like = f.type is int and hasattr(value, "__index__")  # numpy's numbers too
            if not isinstance(value, bool) and (int_like or f.type is float and isinstance(value, numbers.Real)):
                value = f.type(operator.index(value) if f.type is int else value)
                setattr(self, f.name, value)
            options = allowed.get(f.name)
            want = f"one of {options}" if options else "a number" if f.type is float else "an integer"
            if isinstance(options, range):
                want = f"an integer >= {options.start}" + f" and < {options.stop}" * (options.stop < 2**63)
            problem = setting_problem(f.name, value, asdict(self)) if type(value) is f.type else f"must be {want}"
            if problem is None and options is not None and value not in options:
                problem = f"must be {want}"
            need(problem is None, f"GPTConfig.{f.name}={value!r} is invalid: {problem}")
        need(self.n_embd % self.n_head == 0, f"GPTConfig.n_embd={self.n_embd} is invalid: must be divisible by "
             f"n_head={self.n_head}")
        need(self.pos_emb != "rope" or self.n_embd // self.n_head % 2 == 0, f"GPTConfig.n_embd={self.n_embd} is "
             "invalid: RoPE needs an even head size n_embd // n_head")
        self.kv_layout()

    @property
    def sa_delta(self):
        """The value rule's width: a pair meets with probability ~2 * delta, as by the rank rule at T = block_size; a
        query sees 1 + (T - 1) * (delta - delta**2 / 2) keys on average."""
        return self.window / self.block_size

    @property
    def cacheable(self):
        """Whether GPT.generate can decode from an exact KV cache; not rank-rule SA: whether query i sees key j
        depends on later tokens' slots."""
        return self.kv_layout() is not None

    def kv_layout(self, kind=None):
        """How a KVCache stores kind (default: the model's), by its KINDS row: a layout that decodes it, or None."""
        kind = kind or self.attn
        layout, draws = KINDS[kind].kv_layout(self), KINDS[kind].draws
        need(layout in (None, *LAYOUTS), f"attn={kind!r}: its KINDS row names the KV-cache layout {layout!r}, not one "
             f"of kv_cache.LAYOUTS")
        decodes, fix = LAYOUTS.get(layout), "None" if draws else "'prefix' or None"
        need(layout is None or (kind in decodes if decodes else not draws), f"attn={kind!r}: the KV-cache layout "
             f"{layout!r} decodes {' and '.join(decodes or ['kinds without SA draws'])} alone: its row may name {fix}")
        return layout


class GPT(nn.Module):

    def __init__(self, config, sa_seed=0):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Layer(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos_emb == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:  # RoPE's angles
            hs = config.n_embd // config.n_head
            inv_freq = 1.0 / config.rope_base ** (torch.arange(0, hs, 2).float() / hs)  # (hs/2,)
            angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)  # (block_size, hs/2)
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # SA's CPU generator: the same draws on any device; checkpoints save its state
        self.sa_state = torch.Generator().manual_seed(sa_seed).get_state()  # (5056,) uint8, not a buffer
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

    def forward(self, idx, targets=None, lengths=None, cache=None, draws=None):
        """idx (B, T) -> logits (B, T, vocab), and the loss if targets (-1: ignored). lengths: right-padded rows' real
        tokens (draw_sa); cache: a KVCache that idx continues; draws: SA's per layer, not fresh ones."""
        check_tokens(idx, self.config, targets, lengths, cache, draws)
        B, T = idx.size()
        start = 0 if cache is None else cache.start  # idx[:, 0]'s position
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.pos_emb == "learned":
            x = x + self.transformer.wpe(torch.arange(start, start + T, device=idx.device))  # (B, T, C)
        rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T]) if self.config.pos_emb == "rope" \
            else None
        x = self.transformer.drop(x)
        draws = self.draw_sa(B, T, idx.device, lengths) if draws is None else draws
        for layer, draw in zip(self.transformer.h, draws):
            x = layer(x, draw, rope, cache)
        if cache is not None:
            cache.start += T
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def draw_sa(self, B, T, device, lengths=None):
        """SA's fresh draw per layer (None for other kinds): a permutation, or numbers r in [0, 1) by sa_rule="value";
        (T,) or (B, nh, T) by sa_draw. With lengths (B,) of right-padded rows (sa_draws): (B, 1 or nh, T), the value
        rule's (1, 1 or nh, T)."""
        c = self.config
        if not KINDS[c.attn].draws:
            return [None] * c.n_layer
        for name, n in (("B", B), ("T", T)):  # no call when valid: runs in every forward
            if type(n) is not int or n < 0:
                raise InputError(f"{name} must be an integer >= 0, got {n!r}")
        heads = 1 if c.sa_draw == "layer" else c.n_head
        draws = sa_draws(self.sa_state, c.n_layer, B, heads, T, c.sa_rule == "value", lengths, torch.device(device))
        return [checked(d) for d in draws]  # valid as drawn (guards.checked)

    def seed_sa(self, seed):
        """Restart SA's draws from seed."""
        need(hasattr(seed, "__index__") and not isinstance(seed, bool) and -2**63 <= seed < 2**64, f"seed must be an "
             f"integer that fits in 64 bits, got {seed!r}")
        self.sa_state.copy_(torch.Generator().manual_seed(operator.index(seed)).get_state())

    def swap_attention(self, **changes):
        """Training-free swap: these weights with another kind or budget (see swapped)."""
        self.config = swapped(self.config, **changes)
        for layer in self.transformer.h:
            layer.attn.config = self.config
        return self

    def crop_block_size(self, block_size):
        """nanoGPT's (its from_pretrained is checkpoint.from_gpt2): a loaded model's context cut to block_size;
        value-rule SA's sa_delta = window / block_size grows by the same factor."""
        need(block_size <= self.config.block_size, f"block_size={block_size}: the model holds at most "
             f"{self.config.block_size} positions")
        self.config = replace(self.config, block_size=block_size)
        for layer in self.transformer.h:
            layer.attn.config = self.config
        if self.config.pos_emb == "learned":
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        else:
            self.rope_cos, self.rope_sin = self.rope_cos[:block_size], self.rope_sin[:block_size]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matmul weights and embeddings
        no_decay = [p for p in params if p.dim() < 2]  # biases and LayerNorm gains
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = dict(fused=True) if device_type == "cuda" else {}  # every torch of requirements.txt has it
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **fused)

    def flops_per_token(self, T):
        """Training FLOPs per token: 6N for the weights plus 12 * L * C * the keys a query sees (KINDS' keys_seen:
        below T = block_size, it overstates value-rule SA)."""
        c = self.config
        return 6 * self.get_num_params() + 12 * c.n_layer * c.n_embd * KINDS[c.attn].keys_seen(c, T)

    def estimate_mfu(self, tokens_per_iter, dt, T, peak_flops=312e12):
        """Model FLOPs utilisation against an A100's bf16 peak."""
        return self.flops_per_token(T) * tokens_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Append max_new_tokens sampled tokens to idx (B, T); temperature=0: greedy. use_cache: decode from a KVCache
        where the model allows, refilled from the last block_size // 2 tokens when full; else each step recomputes the
        last block_size tokens (nanoGPT)."""
        c = self.config
        check_tokens(idx, c, sampling=(max_new_tokens, temperature, top_k))
        use_cache = use_kv_cache(c, use_cache)
        cache = None
        for _ in range(max_new_tokens):
            if use_cache and (cache is None or cache.start == c.block_size):  # the prompt, or a full cache
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


# -----------------------------------------------------------------------------
# Support, which a first reading skips: RoPE, SA's draws, swaps, autocast.

def apply_rope(x, cos, sin):
    """x (B, nh, T, hs) rotated by its T positions' angles, cos and sin (T, hs/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).type_as(x)  # (B, nh, T, hs)


@torch.library.custom_op("sa::draws", mutates_args=("state",))
def sa_draws(state: torch.Tensor, n: int, B: int, heads: int, T: int, value: bool, lengths: Optional[torch.Tensor],
             device: torch.device) -> torch.Tensor:
    """GPT.draw_sa's draws of n layers, stacked, from a CPU generator's state (advanced in place), sent to device
    without blocking. With lengths, each layer's from a seed: the rank rule's by attention.row_perms, the value rule's
    r of token t, head h the seed's (t * heads + h)-th number. An op, so torch.compile keeps these draws."""
    g = torch.Generator().set_state(state)
    if lengths is not None:
        seeds = torch.randint(2**62, (n,), generator=g).tolist()
        draws = [attention.row_perms(s, lengths, T, heads) if not value else
                 torch.rand(T, heads, generator=torch.Generator().manual_seed(s)).T[None] for s in seeds]
    else:
        shape = [T] if heads == 1 else [B, heads, T]
        draws = [torch.rand(shape, generator=g) if value else torch.randperm(T, generator=g) if heads == 1 else
                 torch.rand(shape, generator=g).argsort(-1) for _ in range(n)]
    state.copy_(g.get_state())
    draws = torch.stack(draws)
    return (draws.pin_memory() if device.type == "cuda" else draws).to(device, non_blocking=True)


@sa_draws.register_fake
def _(state, n, B, heads, T, value, lengths, device):
    shape = (n, T) if heads == 1 and lengths is None else (n, 1 if value and lengths is not None else B, heads, T)
    return torch.empty(shape, dtype=torch.float if value else torch.long, device=device)


def swap_fields():
    """What a swap may change: attn and every kind's settings (KINDS rows); dropout and RoPE were built once."""
    return ("attn", *dict.fromkeys(name for row in KINDS.values() for name in row.settings))


def swapped(config, **changes):
    """config with changes (GPT.swap_attention); InputError where the weights cannot swap."""
    other = sorted(set(changes) - set(swap_fields()))
    need(not other, f"swap_attention changes the attention ({', '.join(swap_fields())}), not {', '.join(other)}")
    new = replace(config, **changes)
    need((new.attn == "sa+swa") == (config.attn == "sa+swa"), f"cannot swap attn={config.attn!r} -> {new.attn!r} "
         "without training: the gates of sa+swa are learned with both paths (a swap may change its window)")
    return new


def autocast(device, dtype):
    """The scripts' mixed precision."""
    need(dtype in DTYPES, f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    return nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=DTYPES[dtype])
