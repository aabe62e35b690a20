"""
A GPT language model with a switchable attention, after nanoGPT. GPTConfig.attn picks every layer's attention:
"full", "swa", "sa" (SWA over a fresh random permutation per layer and forward pass, so that a few layers reach
far), "sa+swa" (the paper's gated dual path) or "moba" (the baseline); the rules live in attention.py's docstring.
GPT.generate decodes from a KV cache (kv_cache.py) where the rule allows it exactly (GPTConfig.cacheable).
"""
import inspect
import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
from torch.nn import functional as F

import attention
from guards import check_int, check_seed, check_temperature, check_tokens
from kv_cache import KVCache, use_kv_cache

ATTN_KINDS = ("full", "swa", "sa", "sa+swa", "moba")
SA_PERM_MODES = ("layer", "head")
SA_RULES = ("rank", "value")
POS_EMBS = ("rope", "learned")
GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The fields that shape the weights: from_pretrained may set every other one on GPT-2's weights. A training-free
# swap (swap_attention) changes only the attention's fields, which the modules read at each forward.
WEIGHT_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "bias", "pos_emb", "block_size")
SWAP_FIELDS = ("attn", "window", "moba_block", "moba_topk", "sa_perm", "sa_rule")


@dataclass
class GPTConfig:
    # The defaults are the model's: GPT-2 small's shape (124M) with SA+SWA. train.py's globals set every field.
    block_size: int = 1024     # maximum sequence length
    vocab_size: int = 50304    # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0       # residual and embedding dropout
    bias: bool = False         # biases in Linears and LayerNorms (GPT-2 has them)
    attn: str = "sa+swa"       # one of ATTN_KINDS
    window: int = 256          # the SWA/SA window: keys per query, itself included
    moba_block: int = 64       # MoBA key block size
    moba_topk: int = 4         # MoBA blocks per query, its own included
    sa_perm: str = "layer"     # "layer": one permutation per layer (the paper); "head": one per batch row and head
    sa_rule: str = "rank"      # "rank": the window over permuted slots (the paper); "value": a KV cache decodes it
    # RoPE, the default, rotates q and k BEFORE the permutation, so SA scores keep their true relative
    # positions, as in the paper. "learned" is GPT-2's absolute embedding, needed to load GPT-2 weights.
    pos_emb: str = "rope"
    rope_base: float = 10000.0

    def __post_init__(self):
        def invalid(field, allowed):
            raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: must be {allowed}")

        real = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
        for field, allowed in (("attn", ATTN_KINDS), ("sa_perm", SA_PERM_MODES), ("sa_rule", SA_RULES),
                               ("pos_emb", POS_EMBS)):
            if getattr(self, field) not in allowed:
                invalid(field, f"one of {allowed}")
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "window", "moba_block", "moba_topk"):
            check_int(getattr(self, field), f"GPTConfig.{field}")
        if self.n_embd % self.n_head:
            invalid("n_embd", f"divisible by n_head={self.n_head}")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            invalid("n_embd", "such that the head size n_embd // n_head is even (RoPE rotates pairs)")
        if not (real(self.dropout) and 0 <= self.dropout < 1):
            invalid("dropout", "a number in [0, 1)")
        if not (real(self.rope_base) and 1 < self.rope_base < math.inf):  # 1e-300 gives inf frequencies, NaN logits
            invalid("rope_base", "a finite number > 1 (RoPE's frequencies are base^(-2i/hs); 10000 is usual)")
        if not isinstance(self.bias, bool):
            invalid("bias", "True or False")

    @property
    def sa_delta(self):
        """The value rule's width delta = window / block_size: a pair then meets as often as under the rank rule, with
        probability about 2 * delta (README.md), so a query sees about `window` keys."""
        return self.window / self.block_size

    @property
    def cacheable(self):
        """Whether GPT.generate can decode this model from a KV cache (kv_cache.py) exactly. Rank-rule SA cannot:
        whether key j is visible to query i depends on the permuted slots of the tokens after i."""
        return self.attn not in ("sa", "sa+swa") or self.sa_rule == "value"


def swapped(config, **changes):
    """config with changes, for a training-free swap (GPT.swap_attention); a ValueError where the weights cannot."""
    if other := sorted(set(changes) - set(SWAP_FIELDS)):  # dropout and RoPE were built once: no swap reaches them
        raise ValueError(f"swap_attention changes the attention ({', '.join(SWAP_FIELDS)}), not {', '.join(other)}")
    new = replace(config, **changes)
    if (new.attn == "sa+swa") != (config.attn == "sa+swa"):
        raise ValueError(f"cannot swap attn={config.attn!r} -> {new.attn!r} without training: the gates of sa+swa are "
                         "learned with both paths, so only an sa+swa model has them (a swap may change the window)")
    return new


def rope_tables(config):
    hs = config.n_embd // config.n_head
    inv_freq = 1.0 / config.rope_base ** (torch.arange(0, hs, 2).float() / hs)   # (hs/2,)
    angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)       # (block_size, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x (B, nh, T, hs) rotated by the angles of its T positions, cos and sin (T, hs/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)                                          # (B, nh, T, hs/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).type_as(x)  # (B, nh, T, hs)


@torch.library.custom_op("sa::draw", mutates_args=("state",))
def draw_from(state: torch.Tensor, n: int, shape: list[int], value: bool) -> torch.Tensor:
    """n SA draws of shape (T,) or (B, heads, T) from a CPU generator's state, advanced in place: uniform r
    in [0, 1) (the value rule) or permutations. A registered op, so that torch.compile keeps these draws."""
    g = torch.Generator().set_state(state)
    draws = torch.stack([torch.rand(shape, generator=g) if value else torch.randperm(shape[0], generator=g)
                         if len(shape) == 1 else torch.rand(shape, generator=g).argsort(-1) for _ in range(n)])
    state.copy_(g.get_state())
    return draws                                                                 # (n, *shape)


draw_from.register_fake(lambda state, n, shape, value:
                         state.new_empty(n, *shape, dtype=torch.float if value else torch.long))


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx  # layer_idx: this layer's place in a KVCache
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.attn == "sa+swa":
            # one sigmoid gate per head and path, from the attention's input ln_1(x): 2 * n_embd * n_head parameters
            self.gate = nn.Linear(config.n_embd, 2 * config.n_head, bias=False)

    def forward(self, x, draw=None, rope=None, cache=None):
        """x (B, T, C); draw: SA's random draw for this layer (GPT.draw_sa), the permutation perm of the rank rule or
        the numbers r of the value rule. cache: a KVCache (kv_cache.py) that
        a prefill (start 0) fills, running the attention below; a decode step (one token) attends over it."""
        B, T, C = x.size()
        cfg, nh = self.config, self.config.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, nh, C // nh).transpose(1, 2)                            # (B, nh, T, hs)
        k = k.view(B, T, nh, C // nh).transpose(1, 2)                            # (B, nh, T, hs)
        v = v.view(B, T, nh, C // nh).transpose(1, 2)                            # (B, nh, T, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            cache.store(self.layer_idx, k, v, draw)

        def attend(kind):
            if cache is not None and cache.start > 0:
                return cache.attend(self.layer_idx, q, kind)
            if kind == "full":
                return attention.full_attention(q, k, v)
            if kind == "swa":
                return attention.sliding_window_attention(q, k, v, cfg.window)
            if kind == "moba":
                return attention.moba_attention(q, k, v, cfg.moba_block, cfg.moba_topk)
            if cfg.sa_rule == "value":
                return attention.stochastic_value_attention(q, k, v, cfg.sa_delta, r=draw)
            return attention.stochastic_attention(q, k, v, cfg.window, perm=draw)

        if cfg.attn == "sa+swa":  # Y = sigmoid(x W_sa) * Y_sa + sigmoid(x W_swa) * Y_swa; both paths share q, k, v
            g = torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)        # (B, 2*nh, T, 1)
            y = g[:, :nh] * attend("sa") + g[:, nh:] * attend("swa")
        else:
            y = attend(cfg.attn)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                         # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # GPT-2's GELU


class Block(nn.Module):

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, draw=None, rope=None, cache=None):
        x = x + self.attn(self.ln_1(x), draw, rope, cache)
        return x + self.mlp(self.ln_2(x))


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
        else:
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # SA's draws come from a CPU generator's state (draw_from), so that a seed gives the same draws on
        # every device; checkpoints save it, so a resumed run draws exactly what it would have.
        self.sa_state = torch.Generator().manual_seed(sa_seed).get_state()     # (5056,) uint8, not a buffer
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            if name.endswith("attn.gate.weight"):  # both gates start at sigmoid(0) = 0.5
                torch.nn.init.zeros_(p)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def draw_sa(self, B, T, device, lengths=None):
        """SA's fresh draw for each layer, (T,) or (B, nh, T) per config.sa_perm: a permutation (sa_rule="rank")
        or a uniform number r in [0, 1) per token (sa_rule="value"). With lengths (B,), the real tokens of right-padded
        rows, each layer draws from a seed of its own, so that a row's draw depends on that seed and its length,
        never on the batch: the rank rule permutes only each row's first lengths[b] tokens (pads keep their
        slots after them); the value rule's r are already so (token t's r depends on the seed and t)."""
        cfg = self.config
        check_int(B, "B", 0)
        check_int(T, "T", 0)
        heads = 1 if cfg.sa_perm == "layer" else cfg.n_head
        if cfg.attn not in ("sa", "sa+swa"):
            return [None] * cfg.n_layer
        if lengths is not None:
            g = torch.Generator().set_state(self.sa_state)
            seeds = torch.randint(2**62, (cfg.n_layer,), generator=g).tolist()
            self.sa_state.copy_(g.get_state())
            if cfg.sa_rule == "rank":
                draws = [attention.row_perms(seed, lengths, T, heads) for seed in seeds]        # (B, 1 or nh, T)
            else:  # (T, heads): token t's r come t-th from the seed, whatever T is
                draws = [torch.rand(T, heads, generator=torch.Generator().manual_seed(seed)).T[None] for seed in seeds]
        else:
            draws = draw_from(self.sa_state, cfg.n_layer, [T] if heads == 1 else [B, heads, T], cfg.sa_rule == "value")
        return [d.to(device) for d in draws]

    def seed_sa(self, seed):
        """Restart SA's draws from seed, an integer of 64 bits."""
        self.sa_state.copy_(torch.Generator().manual_seed(check_seed(seed)).get_state())

    def forward(self, idx, targets=None, lengths=None, cache=None, draws=None):
        """idx (B, T) -> logits (B, T, vocab), and the loss if targets. lengths: see draw_sa.
        cache: a KVCache (kv_cache.py); idx continues the tokens it has seen, all at once
        into an empty cache or one at a time. draws: SA's draw per layer, instead of fresh ones."""
        cfg = self.config
        check_tokens(idx, cfg.vocab_size, lengths, targets)
        B, T = idx.size()
        start = 0 if cache is None else cache.start                              # idx[:, 0]'s absolute position
        if start + T > cfg.block_size:
            raise ValueError(f"sequence length {start + T} exceeds block_size {cfg.block_size}")
        if cache is not None and (lengths is not None or (start and T > 1)):
            raise ValueError(f"a KV cache takes no lengths, and one token at a time after the prompt; "
                             f"got {T} at {start}")
        if draws is not None and (not isinstance(draws, (list, tuple)) or len(draws) != cfg.n_layer):  # zip: fewer
            raise ValueError(f"draws must be a list of one draw per layer, {cfg.n_layer}, got a {type(draws).__name__}"
                             + (f" of {len(draws)}" if isinstance(draws, (list, tuple)) else ""))
        if cache is not None and cache.config != cfg:  # another model's, or this one's before a swap_attention
            raise ValueError("this KV cache was made for another config than the model's: make a new KVCache(config)")
        x = self.transformer.wte(idx)                                            # (B, T, C)
        if cfg.pos_emb == "learned":
            x = x + self.transformer.wpe(torch.arange(start, start + T, device=idx.device))  # (B, T, C)
        rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T]) if cfg.pos_emb == "rope" else None
        x = self.transformer.drop(x)
        draws = self.draw_sa(B, T, idx.device, lengths) if draws is None else draws
        for block, draw in zip(self.transformer.h, draws):
            x = block(x, draw, rope, cache)
        if cache is not None:
            cache.start += T
        logits = self.lm_head(self.transformer.ln_f(x))                          # (B, T, vocab)
        loss = None
        if targets is not None:  # targets of -1 are ignored (MQAR scores answers only)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def swap_attention(self, **changes):
        """Training-free swap: evaluate these weights with another attention kind or budget (see swapped)."""
        self.config = swapped(self.config, **changes)
        for block in self.transformer.h:
            block.attn.config = self.config
        return self

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]    # matmul weights and embeddings
        no_decay = [p for p in params if p.dim() < 2]  # biases and LayerNorm gains
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **(dict(fused=True) if fused else {}))

    def flops_per_token(self, T):
        """Training FLOPs per token: 6N for the weights plus 12 * L * C * (keys a query attends)."""
        cfg = self.config
        keys = {"full": (T + 1) / 2, "swa": min(cfg.window, T), "sa": min(cfg.window, T),
                "sa+swa": 2 * min(cfg.window, T), "moba": min(cfg.moba_block * cfg.moba_topk, T)}[cfg.attn]
        return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * keys

    def estimate_mfu(self, tokens_per_iter, dt, T, peak_flops=312e12):
        """Model FLOPs utilisation against an A100's bf16 peak."""
        return self.flops_per_token(T) * tokens_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Append max_new_tokens sampled tokens to idx (B, T). temperature=0: greedy, the most likely token.
        use_cache: decode from a KVCache (kv_cache.py), one token per step, where use_kv_cache allows it; else every
        step recomputes the whole prefix. Past block_size, without the cache every step crops the context to its last
        block_size tokens (nanoGPT); with it, a full cache is refilled from the last block_size // 2 tokens."""
        cfg = self.config
        check_temperature(temperature)
        check_int(max_new_tokens, "max_new_tokens", least=0)
        if top_k is not None:
            check_int(top_k, "top_k (None: sample among all tokens)")
        check_tokens(idx, cfg.vocab_size)
        if idx.size(1) == 0:
            raise ValueError(f"idx of shape {tuple(idx.shape)}: use a prompt (B, T) of at least one token")
        use_cache = use_kv_cache(cfg, use_cache)
        cache = None
        for _ in range(max_new_tokens):
            if use_cache and (cache is None or cache.start == cfg.block_size):  # the prompt, or a full cache: fill it
                keep = cfg.block_size if cache is None else max(1, cfg.block_size // 2)
                cache = KVCache(cfg)
                logits, _ = self(idx[:, -keep:], cache=cache)
            else:  # with the cache, the newest token; without, the last block_size tokens (cache is None)
                logits, _ = self(idx[:, -1:] if use_cache else idx[:, -cfg.block_size:], cache=cache)
            logits = logits[:, -1, :].double()                                   # (B, vocab), whatever the autocast
            if temperature == 0:
                idx_next = logits.argmax(-1, keepdim=True)                       # (B, 1)
            else:  # minus the max first: a tiny temperature then gives 0 and -inf, never inf - inf
                logits = (logits - logits.max(-1, keepdim=True).values) / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """GPT-2's weights in our GPT, as nanoGPT does it. model_type is a size name (GPT2_SIZES, downloaded
        through transformers) or a transformers GPT2LMHeadModel already built. override_args may set the
        fields that carry no weights (not WEIGHT_FIELDS); attn="sa+swa" adds gates at their init."""
        override_args = override_args or {}
        allowed = [f.name for f in fields(GPTConfig) if f.name not in WEIGHT_FIELDS]
        if set(override_args) - set(allowed):
            raise ValueError(f"from_pretrained can override only {sorted(allowed)}, got {sorted(override_args)}")
        if isinstance(model_type, nn.Module):
            hf = model_type
        else:
            if model_type not in GPT2_SIZES:
                raise ValueError(f"unknown GPT-2 model_type {model_type!r}: use one of {', '.join(GPT2_SIZES)}")
            try:
                from transformers import GPT2LMHeadModel
            except ImportError:
                raise ValueError("loading GPT-2 weights needs transformers: pip install transformers") from None
            hf = GPT2LMHeadModel.from_pretrained(model_type)  # offline: transformers' OSError (eval.py: one line)
        c = hf.config
        # our Block must compute exactly what GPT-2's does
        for field, value, supported in (
                ("activation_function", c.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
                ("layer_norm_epsilon", c.layer_norm_epsilon, (1e-5,)), ("n_inner", c.n_inner, (None, 4 * c.n_embd))):
            if value not in supported:
                raise ValueError(f"GPT-2 config {field}={value!r} is not supported: our GPT needs one of {supported}")
        config = GPTConfig(**{"block_size": c.n_positions, "vocab_size": c.vocab_size, "n_layer": c.n_layer,
                              "n_head": c.n_head, "n_embd": c.n_embd, "bias": True, "pos_emb": "learned",
                              "attn": "full", "dropout": 0.0, **override_args})
        model = cls(config)
        sd, sd_hf = model.state_dict(), hf.state_dict()
        # GPT-2 stores these as Conv1D, (in, out): transpose into nn.Linear's (out, in)
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        with torch.no_grad():
            for k, v in sd.items():
                if k.endswith("attn.gate.weight"):
                    continue
                w = sd_hf[k].t() if k.endswith(conv1d) else sd_hf[k]
                if w.shape != v.shape:
                    raise ValueError(f"GPT-2 weight {k} has shape {tuple(w.shape)}, ours {tuple(v.shape)}")
                v.copy_(w)
        return model

    def model_args(self):
        return asdict(self.config)


def autocast(device, dtype):
    """The mixed-precision context of train.py, sample.py and eval.py: none for "float32",
    else torch.autocast to "bfloat16" or "float16" on device's type."""
    if dtype not in DTYPES or not isinstance(device, str):
        raise ValueError(f"device={device!r}, dtype={dtype!r}: use a device's name and one of {', '.join(DTYPES)}")
    return nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=DTYPES[dtype])
