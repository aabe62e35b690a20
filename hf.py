"""Support, which a first reading skips: eval.py's training-free swaps of this repo's attentions
into a Hugging Face transformers model (Qwen3, Llama...), and SA's draws for right-padded rows,
which eval.py scores in batches (our GPT's draws: padded_sa_draws)."""
import math

import torch
import torch.nn.functional as F

import attention
from guards import InputError, check_count, checked, need


def check_lengths(idx, lengths):
    """An InputError unless lengths is a (B,) integer tensor of the real tokens of each of idx's
    right-padded rows."""
    (B, T), ok = idx.shape, isinstance(lengths, torch.Tensor)
    ok = ok and lengths.dtype in (torch.long, torch.int) and lengths.shape == (B,)
    if not (ok and bool(((lengths >= 1) & (lengths <= T)).all())):
        raise InputError(f"lengths must be a (B,)=({B},) integer tensor of real tokens per row, "
                         f"1 <= lengths <= T={T}, got {' '.join(str(lengths).split())[:80]}")


def row_perms(seed, lengths, T, heads=1):
    """SA's permutations (B, heads, T) for right-padded rows: row b permutes its first lengths[b]
    tokens, its pads keep their slots. Each row's comes from `seed` and its length alone: neither
    its padding nor the other rows of its batch change it."""
    rows = []
    for n in lengths.tolist():
        g = torch.Generator().manual_seed(seed)
        real = torch.rand(heads, n, generator=g).argsort(-1)  # (heads, n): the real tokens
        pads = torch.arange(n, T).expand(heads, -1)  # (heads, T - n): the pads, in place
        rows.append(torch.cat([real, pads], -1))  # (heads, T)
    return torch.stack(rows)  # (B, heads, T)


def padded_sa_draws(model, idx, lengths):
    """One SA draw per layer of our GPT `model` for idx (B, T), whose rows are right-padded to
    lengths (B,) real tokens; None for a kind without SA. Each layer's draw comes from one seed of
    the model's SA generator: by the rank rule, row_perms; by the value rule, the number r of token
    t and head h is the seed's own, whatever the padding. So a document's score depends on the
    seed alone, not on its batch or padding."""
    check_lengths(idx, lengths)
    c, T = model.config, idx.shape[1]
    if c.attn not in ("sa", "sa+swa"):
        return None
    heads = 1 if c.sa_draw == "layer" else c.n_head
    g = torch.Generator().set_state(model.sa_state)
    seeds = torch.randint(2**62, (c.n_layer,), generator=g).tolist()
    model.sa_state.copy_(g.get_state())  # the next forward draws new seeds
    draws = []
    for seed in seeds:
        if c.sa_rule == "value":
            r = torch.rand(T, heads, generator=torch.Generator().manual_seed(seed))  # (T, heads)
            draw = r.T.contiguous()[None]  # (1, heads, T), contiguous as torch.searchsorted wants
        else:
            draw = row_perms(seed, lengths, T, heads)  # (B, heads, T)
        draws.append(checked(draw.to(idx.device)))  # valid: attention.py need not check its values
    return draws


def hf_context_length(hf_config, tokenizer_max=None):
    """lm-eval's resolve_max_length: the model's length, else the tokenizer's unless unset (~1e30), else 2048."""
    text = getattr(hf_config, "text_config", None) or hf_config
    own = [n for a in ("n_positions", "max_position_embeddings", "n_ctx") if (n := getattr(text, a, None)) is not None]
    return int(own[0] if own else tokenizer_max if tokenizer_max is not None and tokenizer_max < 1e29 else 2048)


class HFLM:  # as eval.OurLM, for a transformers model

    def __init__(self, model, tok, block_size, device, tokenizer_max=None):
        self.model, self.tok, self.device, hf_config = model.eval(), tok, device, model.config
        own, text = hf_context_length(hf_config, tokenizer_max), hf_config.get_text_config()
        self.block_size, self.native = min(block_size or own, own), {"attn": "full"}
        # Qwen3's head_dim is not hidden_size // heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.native_impl, self.generator = hf_config._attn_implementation, torch.Generator()  # "full"; SA's seeds
        self.seed = self.generator.manual_seed

    def logits(self, idx, lengths=None):
        """idx (B, T) -> logits (B, T, vocab); lengths (B,): each right-padded row's real tokens."""
        T = idx.shape[1]  # the mask keeps the padding out of SA's permutations
        if lengths is not None:
            check_lengths(idx, lengths)
        padded = lengths is not None and not bool((lengths == T).all())
        mask = (torch.arange(T) < lengths[:, None]).to(idx.device) if padded else None
        return self.model(input_ids=idx, attention_mask=mask, use_cache=False).logits  # (B, T, vocab)

    def use(self, swap):
        impl = self.native_impl if swap["attn"] == "full" else register_hf_attention(**swap, generator=self.generator)
        self.model.set_attn_implementation(impl)


def register_hf_attention(attn, window=None, moba_chunk=64, moba_topk=4, generator=None, **other):
    """Register attn with transformers (Qwen3, Llama... call it after RoPE) and a mask function handing it the 2D
    padding mask (a row, left or right padded, attends as if alone); return its name for set_attn_implementation.
    SA seeds from `generator`. Decoding on a KV cache, swa sees the last `window` keys, sa and moba
    all of them (and print so, once). Other settings (sa_rule...) are refused, and so are other
    attention kwargs if set."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        raise InputError("Hugging Face models need transformers: pip install transformers") from None
    need(attn in ("swa", "sa", "moba"), f"a Hugging Face model can run swa, sa or moba, not {attn!r}"
         + ": sa+swa needs gates trained with the model" * (attn == "sa+swa"))
    need(not other, f"a Hugging Face model's {attn} takes window, moba_chunk, moba_topk, not {', '.join(other)}")
    if attn == "moba":
        name = f"moba_c{check_count(moba_chunk, 'moba_chunk')}_k{check_count(moba_topk, 'moba_topk')}"
    else:
        name = f"{attn}_w{check_count(window, 'window')}"
    generator, told = generator or torch.Generator(), []

    def padding_mask(attention_mask=None, kv_length=0, kv_offset=0, **_):  # (B, kv_length), True: real; None: no pad
        if attention_mask is not None:
            m = F.pad(attention_mask.bool(), (0, max(0, kv_offset + kv_length - attention_mask.shape[-1])))
            m = m[:, kv_offset:kv_offset + kv_length]  # this layer's keys: a sliding cache drops some
            return None if bool(m.all()) else m

    def sparse(q, k, v, lengths):
        if attn == "sa":
            T, seed = q.shape[2], int(torch.randint(2 ** 62, (), generator=generator))
            rows = torch.tensor([T]) if lengths is None else lengths  # one unpadded row, or each's
            perm = row_perms(seed, rows, T)  # (B or 1, 1, T)
            perm = perm[0, 0] if lengths is None else perm  # (T,) without padding
            # a valid permutation: attention.py need not check its values
            return attention.stochastic_attention(q, k, v, window, checked(perm.to(q.device)))
        return attention.sliding_window_attention(q, k, v, window) if attn == "swa" else \
            attention.moba_attention(q, k, v, moba_chunk, moba_topk)

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=True, **kwargs):
        bad = [f"{k}={v!r}" for k, v in kwargs.items() if k not in ("position_ids", "use_cache", "sliding_window")
               and v not in (None, False)]  # sliding_window: the swap replaces it
        bad += [f"dropout={dropout}"] * bool(dropout) + ["is_causal=False"] * (is_causal is False)
        need(not bad, f"the {name} attention does not implement {', '.join(bad)}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise InputError(f"{name} takes a 2D padding mask, not a {attention_mask.dim()}D one")
        (B, H, T, D), S = query.shape, key.shape[2]
        k, v = (x.repeat_interleave(H // key.shape[1], dim=1) for x in (key, value))  # (B, H, S, D)
        q = query if scaling is None else query * (scaling * math.sqrt(D))  # (B, H, T, D)
        if S != T:  # decoding on a KV cache
            need(T == 1, f"{name} takes T queries on T keys, or one on a cache; got {T} on {S}")
            keep = torch.arange(S, device=q.device) >= (S - window if attn == "swa" else 0)  # (S,): swa's last keys
            keep = keep if attention_mask is None else keep & attention_mask  # (B, S)
            if attn == "swa":
                own = kwargs.get("sliding_window")
                need(own is None or own >= window, f"{name} cannot decode: the cache keeps sliding_window={own} keys")
            elif not told:
                print(f"{name}: decoding on a KV cache runs full attention over the cache")
                told.append(True)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[..., None, None, :])  # (B, H, 1, D)
        elif attention_mask is None:
            y = sparse(q, k, v, None)
        else:  # real tokens first, in order, pads after
            order = torch.argsort((~attention_mask).to(torch.int8), dim=1, stable=True)  # (B, T)
            idx = order[:, None, :, None].expand(B, H, T, D)  # (B, H, T, D)
            y = sparse(q.gather(2, idx), k.gather(2, idx), v.gather(2, idx), attention_mask.sum(1))
            y = torch.empty_like(y).scatter_(2, idx, y)  # (B, H, T, D) in token order
        return y.transpose(1, 2).contiguous(), None  # (B, T, H, D)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name
