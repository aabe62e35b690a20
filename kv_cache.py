"""
Support, which a first reading skips. The KV cache of GPT.generate (model.py): what each layer keeps of the tokens seen so far, and the attention
of one new token over it by its kind's rule (attention.py's docstring). It is exact: a step's output is the
last row of one forward over all the tokens so far, which tests/test_generate.py checks for every kind.

A layer keeps k and v (B, nh, S, hs), the token at absolute position p in slot p % S. SWA keeps S = window
slots, so a key is overwritten exactly when it leaves every later query's window; the other kinds keep the
whole block_size (MoBA rounded up to whole chunks), and MoBA also keeps the fp32 key mean of each complete chunk.
Value-rule SA keeps its tokens' numbers r sorted, with the position of each, so that a step's visible keys
are one contiguous run found by two binary searches: about 2 * window keys at T = block_size, not all T.
Rank-rule SA has no cache (GPTConfig.cacheable says why). What a layer keeps is its kind's KINDS row's cache:
"all", "window", "chunks" or "sorted"; a kind whose row says None has no cache, and generate recomputes the prefix.
"""
import math
import sys

import torch
import torch.nn.functional as F

import attention
import tiled
from guards import InputError, check_inputs, need
from model import KINDS


def use_kv_cache(config, use_cache):
    """use_cache where config.cacheable. Asked for on rank-rule SA, it is False, and stderr says so."""
    if use_cache and not config.cacheable:
        print(f"attn={config.attn!r} with sa_rule='rank' cannot be decoded from a KV cache exactly: "
              "every token recomputes the whole prefix", file=sys.stderr)
    return use_cache and config.cacheable


class KVCache:

    def __init__(self, config):
        need(hasattr(config, "cacheable"), f"a KV cache takes a model's GPTConfig, got {type(config).__name__}")
        need(config.cacheable, f"a KV cache takes a cacheable model (a kind whose KINDS row has a cache; not rank-rule "
             f"SA), got attn={config.attn!r} with sa_rule={config.sa_rule!r}")
        self.config = config
        self.start = 0                                   # tokens seen: the absolute position of the next one
        self.layers = [{} for _ in range(config.n_layer)]
        self.keeps = KINDS[config.attn].cache(config)    # "all", "window", "chunks" or "sorted"
        self.moba_chunk = min(config.moba_chunk, config.block_size)  # past block_size one chunk: memory follows T

    def store(self, i, k, v, draw=None):
        """Write layer i's k, v (B, nh, T, hs) of positions start..start+T-1, allocating its buffers on
        the first call (in k's dtype: what autocast produced); value-rule SA also files the tokens'
        numbers r (the layer's draw, (T,) or (B, nh, T)) into the sorted rs (R, n) with their positions
        ps (R, n), R = 1, or B * nh for sa_perm="head"."""
        c, cache, start, (B, nh, T, hs) = self.config, self.layers[i], self.start, k.shape
        need(not cache or cache["k"].shape[0] == B, f"this KV cache holds {cache and cache['k'].shape[0]} rows, got "
             f"a batch of {B}: start a new cache")
        if self.keeps == "sorted":
            check_inputs(k, k, v, r=draw)
        if not cache:
            chunk = self.moba_chunk
            S = {"window": min(c.window, c.block_size),
                 "chunks": math.ceil(c.block_size / chunk) * chunk}.get(self.keeps, c.block_size)
            cache.update(k=k.new_zeros(B, nh, S, hs), v=v.new_zeros(B, nh, S, hs))
            if self.keeps == "chunks":
                cache["kmean"] = k.new_zeros(B, nh, S // chunk, hs, dtype=torch.float32)
        S = cache["k"].shape[2]
        n = min(T, S)                                            # only the last S positions can ever be seen
        slots = torch.arange(start + T - n, start + T, device=k.device) % S
        cache["k"][:, :, slots] = k[:, :, T - n:]                               # (B, nh, n, hs) into their slots
        cache["v"][:, :, slots] = v[:, :, T - n:]
        if self.keeps == "chunks":  # the chunks these tokens complete, averaged as moba_select averages them
            chunk = self.moba_chunk
            lo, hi = start // chunk, (start + T) // chunk
            if hi > lo:
                cache["kmean"][:, :, lo:hi] = tiled.chunk_means(cache["k"][:, :, lo * chunk:hi * chunk], chunk)
        if self.keeps == "sorted":
            r = draw.expand(B, nh, T).reshape(-1, T) if draw.dim() == 3 else draw[None]  # (R, T)
            cache["rq"] = r[:, -1:]                                 # (R, 1): the newest token's r, a step's query
            r, order = r.sort(-1)                                                       # (R, T) ascending
            p = start + order                                                           # (R, T) their positions
            if "rs" in cache:  # merge into the sorted rs: each r's place is its rank in the union
                rs, ps = cache["rs"], cache["ps"]                                       # (R, m) each
                at_old = torch.arange(rs.shape[1], device=r.device) + torch.searchsorted(r, rs)  # (R, m)
                at_new = torch.arange(T, device=r.device) + torch.searchsorted(rs, r, right=True)  # (R, T)
                r = rs.new_empty(r.shape[0], rs.shape[1] + T).scatter_(1, at_old, rs).scatter_(1, at_new, r)
                p = ps.new_empty(r.shape).scatter_(1, at_old, ps).scatter_(1, at_new, p)  # (R, m + T) each
            cache["rs"], cache["ps"] = r, p

    def attend(self, i, q, kind):
        """The attention of one query q (B, nh, 1, hs) at position start over layer i's cache (which
        holds it already) by `kind`'s rule: a masked softmax with autocast off, the scores in fp32 as
        attention.py computes them, the output in the cache's dtype."""
        c, cache, start, (B, nh, _, hs) = self.config, self.layers[i], self.start, q.shape
        if q.numel() == 0:  # an empty batch (or head size): the empty output, as attention.py's
            return q.new_zeros(q.shape)
        S, rule = cache["k"].shape[2], KINDS[kind].cache(c)
        if rule in ("all", "window"):  # full: every position so far; swa: the last `window` of them
            first = 0 if rule == "all" else max(0, start + 1 - c.window)
            slots = torch.arange(first, start + 1, device=q.device) % S
            keys, vals = cache["k"][:, :, slots], cache["v"][:, :, slots]                # (B, nh, n, hs)
            mask = torch.ones(len(slots), dtype=torch.bool, device=q.device)
        elif rule == "sorted":  # value-rule SA: the run of rs within delta (and a margin) of the query's r
            delta, rs, rq = c.sa_delta, cache["rs"], cache["rq"]                      # rs (R, m), rq (R, 1)
            lo = torch.searchsorted(rs, rq - delta - attention.VALUE_MARGIN)             # (R, 1)
            hi = torch.searchsorted(rs, rq + delta + attention.VALUE_MARGIN)             # (R, 1)
            run = lo + torch.arange(int((hi - lo).max()), device=q.device)              # (R, n)
            at = run.clamp(max=rs.shape[1] - 1)                                          # (R, n) in range
            mask = (run < hi) & ((rq - rs.gather(1, at)).abs() < delta)                  # (R, n): the rule itself
            pos = cache["ps"].gather(1, at)                                              # (R, n) their positions
            if pos.shape[0] == 1:
                keys, vals, mask = cache["k"][:, :, pos[0]], cache["v"][:, :, pos[0]], mask[0]  # (B, nh, n, hs)
            else:
                at = pos.view(B, nh, -1, 1).expand(-1, -1, -1, hs)                       # (B, nh, n, hs)
                keys, vals, mask = cache["k"].gather(2, at), cache["v"].gather(2, at), mask.view(B, nh, 1, -1)
        else:  # "chunks": MoBA
            keys, vals, mask = self._moba_keys(cache, q)
        with torch.autocast(q.device.type, enabled=False):
            return attention.masked_attention(q, keys, vals, mask)                       # (B, nh, 1, hs)

    def _moba_keys(self, cache, q):
        """The keys, values and mask of MoBA's step: the own chunk so far, plus the top_k - 1 past chunks
        with the largest q . kmean, chosen as moba_select chooses the last row of a forward over them."""
        c, start, (B, nh) = self.config, self.start, q.shape[:2]
        chunk = self.moba_chunk
        nc = start // chunk                                     # complete chunks, all strictly past
        own = nc * chunk                                        # the own chunk's first position
        keys, vals = cache["k"][:, :, own:start + 1], cache["v"][:, :, own:start + 1]  # (B, nh, start+1-own, hs)
        mask = torch.ones(keys.shape[2], dtype=torch.bool, device=q.device)
        if c.moba_topk > 1 and nc > 0:
            # the own chunk is one more column, masked to -inf, so that topk sees moba_select's row
            # and breaks ties alike; fp32 with autocast off, as moba_select scores
            with torch.autocast(q.device.type, enabled=False):
                scores = q.float() @ cache["kmean"][:, :, :nc].transpose(-1, -2)     # (B, nh, 1, nc)
            scores = F.pad(scores, (0, 1), value=float("-inf"))                       # (B, nh, 1, nc+1)
            top, idx = scores.topk(min(c.moba_topk - 1, nc + 1), dim=-1)           # (B, nh, 1, n)
            bh = (torch.arange(B, device=q.device)[:, None, None], torch.arange(nh, device=q.device)[None, :, None])
            chunks = idx[:, :, 0]                                                      # (B, nh, n)
            ksel = cache["k"].unflatten(2, (-1, chunk))[bh + (chunks,)].flatten(2, 3)      # (B, nh, n*chunk, hs)
            vsel = cache["v"].unflatten(2, (-1, chunk))[bh + (chunks,)].flatten(2, 3)      # (B, nh, n*chunk, hs)
            keys, vals = torch.cat([keys, ksel], 2), torch.cat([vals, vsel], 2)        # (B, nh, n_keys, hs)
            mask = torch.cat([mask.expand(B, nh, 1, -1), (top > float("-inf")).repeat_interleave(chunk, -1)], -1)
        return keys, vals, mask
