"""
Support, which a first reading skips. GPT.generate's exact KV cache: a step's output is the last row of a forward over
the tokens it holds (all so far, until generate refills it); tests/test_generate.py checks each kind.

Per layer: k, v (B, nh, S, hs), position p in cell p % S, S = block_size, and what its kind needs:
full: no more. swa: S = min(window, block_size), a key overwritten once no query sees it. moba: S rounded up to whole
chunks, and each complete chunk's fp32 mean key. sa by the value rule (and sa+swa): r sorted with positions; two binary
searches find a step's keys (about 2 * window of them at T = block_size).
Rank-rule SA, and a kind without a branch here, have no cache: generate recomputes the prefix at every token.
"""
import math
import sys
from dataclasses import replace

import torch

import attention
import moba
from guards import check_inputs, need


def cacheable(config):
    """Whether config's kind decodes exactly from a KVCache: not rank-rule SA, where whether query i sees key j
    depends on later tokens' slots."""
    return config.attn in ("full", "swa", "moba") or config.attn in ("sa", "sa+swa") and config.sa_rule == "value"


def use_kv_cache(config, use_cache):
    if use_cache and not cacheable(config):
        print(f"{uncached(config)} cannot be decoded from a KV cache: each token recomputes the prefix",
              file=sys.stderr)
    return use_cache and cacheable(config)


def uncached(config):
    """What keeps config from a KV cache, for a message: its kind, and its sa_rule if the value rule's decodes."""
    return f"attn={config.attn!r}" + f" with sa_rule={config.sa_rule!r}" * cacheable(replace(config, sa_rule="value"))


class KVCache:

    def __init__(self, config):
        need(hasattr(config, "sa_rule"), f"a KV cache takes a model's GPTConfig, got {type(config).__name__}")
        need(cacheable(config), f"a KV cache takes a cacheable model, not {uncached(config)}")
        self.config, self.layers = config, [{} for _ in range(config.n_layer)]
        self.start = 0  # tokens seen: the next one's position
        self.chunk = min(config.moba_chunk, config.block_size)  # MoBA's

    def store(self, i, k, v, draw=None):
        """Store layer i's k, v (B, nh, T, hs) of positions start..; value-rule SA merges the draw's r, (T,) or
        (B, nh, T), into rs (R, m), their positions into ps: R = 1 or B * nh."""
        c, cache, start, chunk, (B, nh, T, hs) = self.config, self.layers[i], self.start, self.chunk, k.shape
        need(not cache or cache["k"].shape[0] == B, f"this KV cache holds {cache and cache['k'].shape[0]} rows, got "
             f"a batch of {B}: start a new cache")
        sorted_r = c.attn in ("sa", "sa+swa")  # the value rule: cacheable says so
        if sorted_r:
            check_inputs(k, k, v, r=draw)
        if not cache:
            S = c.block_size
            if c.attn == "swa":
                S = min(c.window, c.block_size)
            if c.attn == "moba":
                S = math.ceil(c.block_size / chunk) * chunk
            cache.update(k=k.new_zeros(B, nh, S, hs), v=v.new_zeros(B, nh, S, hs))
            if c.attn == "moba":
                cache["kmean"] = k.new_zeros(B, nh, S // chunk, hs, dtype=torch.float32)
        S = cache["k"].shape[2]
        n = min(T, S)  # the last S positions only
        cells = torch.arange(start + T - n, start + T, device=k.device) % S
        cache["k"][:, :, cells] = k[:, :, T - n:]  # (B, nh, n, hs)
        cache["v"][:, :, cells] = v[:, :, T - n:]
        lo, hi = start // chunk, (start + T) // chunk
        if c.attn == "moba" and hi > lo:  # chunks completed, averaged as moba_select does
            cache["kmean"][:, :, lo:hi] = moba.chunk_means(cache["k"][:, :, lo * chunk:hi * chunk], chunk)
        if sorted_r:
            r = draw.expand(B, nh, T).reshape(-1, T) if draw.dim() == 3 else draw[None]  # (R, T)
            cache["rq"] = r[:, -1:]  # (R, 1): the newest r, a step's query
            r, order = r.sort(-1)  # (R, T) ascending
            p = start + order  # (R, T) their positions
            if "rs" in cache:  # merged: each r's place is its rank in the union
                rs, ps = cache["rs"], cache["ps"]  # (R, m) each
                at_old = torch.arange(rs.shape[1], device=r.device) + torch.searchsorted(r, rs)  # (R, m)
                at_new = torch.arange(T, device=r.device) + torch.searchsorted(rs, r, right=True)  # (R, T)
                r = rs.new_empty(r.shape[0], rs.shape[1] + T).scatter_(1, at_old, rs).scatter_(1, at_new, r)
                p = ps.new_empty(r.shape).scatter_(1, at_old, ps).scatter_(1, at_new, p)  # (R, m + T) each
            cache["rs"], cache["ps"] = r, p

    def attend(self, i, q, kind):
        """q (B, nh, 1, hs) of position start, stored, over layer i's cache by attention `kind` ("sa": the value
        rule)."""
        c, cache, start, chunk, (B, nh, _, hs) = self.config, self.layers[i], self.start, self.chunk, q.shape
        if q.numel() == 0:  # an empty batch or head
            return torch.zeros_like(q)
        S, nc = cache["k"].shape[2], start // chunk  # nc: MoBA's complete chunks
        if kind == "sa":  # the run of rs within delta (plus a margin) of rq
            delta, rs, rq = c.sa_delta, cache["rs"], cache["rq"]  # rs (R, m), rq (R, 1)
            reach = delta + attention.VALUE_MARGIN
            lo, hi = torch.searchsorted(rs, rq - reach), torch.searchsorted(rs, rq + reach)  # (R, 1) each
            run = lo + torch.arange(int((hi - lo).max()), device=q.device)  # (R, n)
            at = run.clamp(max=rs.shape[1] - 1)  # (R, n)
            mask = ((run < hi) & ((rq - rs.gather(1, at)).abs() < delta)).expand(B * nh, -1)  # the rule itself
            at = cache["ps"].gather(1, at).expand(B * nh, -1).view(B, nh, -1, 1).expand(-1, -1, -1, hs)  # positions
            keys, vals, mask = cache["k"].gather(2, at), cache["v"].gather(2, at), mask.view(B, nh, 1, -1)
            return attention.masked_attention(q, keys, vals, mask)  # (B, nh, 1, hs)
        # positions first..start: all (full), the last `window` (swa), or MoBA's own chunk so far
        first = {"full": 0, "swa": max(0, start + 1 - c.window), "moba": nc * chunk}[kind]
        cells = torch.arange(first, start + 1, device=q.device) % S
        keys, vals = cache["k"][:, :, cells], cache["v"][:, :, cells]  # (B, nh, n, hs)
        mask = torch.ones_like(cells, dtype=torch.bool)
        if kind == "moba":  # and the moba_topk - 1 past chunks of largest q . kmean, if any
            # moba_select's row (fp32, own chunk at -inf), so topk breaks ties alike
            with torch.autocast(q.device.type, enabled=False):
                scores = q.float() @ cache["kmean"][:, :, :nc + 1].transpose(-1, -2)  # (B, nh, 1, nc+1)
            scores[..., nc] = float("-inf")
            top, idx = scores.topk(min(c.moba_topk - 1, nc + 1), dim=-1)  # (B, nh, 1, n)
            at = idx[:, :, 0, :, None, None].expand(-1, -1, -1, chunk, hs)  # (B, nh, n, chunk, hs): the chosen chunks
            sel = [cache[x].unflatten(2, (-1, chunk)).gather(2, at).flatten(2, 3) for x in "kv"]  # (B, nh, n*chunk, hs)
            keys, vals = torch.cat([keys, sel[0]], 2), torch.cat([vals, sel[1]], 2)  # (B, nh, n_keys, hs)
            mask = torch.cat([mask.expand(B, nh, 1, -1), (top > float("-inf")).repeat_interleave(chunk, -1)], -1)
        return attention.masked_attention(q, keys, vals, mask)  # (B, nh, 1, hs)
