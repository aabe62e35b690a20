"""Tests for GPT.generate and its KV cache (model.py). Run: python -m pytest -q test_generate.py"""
import pytest
import torch

import attention
from kv_cache import KVCache
from model import GPT, GPTConfig
from test_attention import MaxNumel

# lengths that are no multiple of the window (7) or the MoBA block (8)
PROMPT, TOTAL = 13, 90


def tiny(attn, **kw):
    torch.manual_seed(0)
    cfg = dict(block_size=96, vocab_size=61, n_layer=2, n_head=2, n_embd=32, window=7, moba_block=8, moba_topk=3)
    return GPT(GPTConfig(attn=attn, **{**cfg, **kw})).eval()


def tokens(B, T, seed=1):
    return torch.randint(61, (B, T), generator=torch.Generator().manual_seed(seed))


VALUE = dict(sa_rule="value")


def cached_draws(model, cache, B, T):
    """The SA keys r that a cache holds (sorted, with their positions), as GPT.forward's draws:
    (T,) or (B, nh, T) per layer, in position order."""
    cfg = model.config
    if "rs" not in cache.layers[0]:
        return None
    r = [torch.zeros_like(layer["rs"]).scatter_(1, layer["ps"], layer["rs"]) for layer in cache.layers]  # (R, T) each
    return [x[0] if cfg.sa_perm == "layer" else x.view(B, cfg.n_head, T) for x in r]


@pytest.mark.parametrize("attn,kw", [("full", {}), ("full", dict(pos_emb="learned")), ("swa", {}),
                                     ("swa", dict(pos_emb="learned")), ("swa", dict(window=200)),
                                     ("moba", {}), ("moba", dict(pos_emb="learned")), ("moba", dict(moba_topk=1)),
                                     ("sa", VALUE), ("sa", dict(VALUE, pos_emb="learned")), ("sa", dict(VALUE, window=200)),
                                     ("sa", dict(VALUE, sa_perm="head")), ("sa+swa", VALUE),
                                     ("sa+swa", dict(VALUE, sa_perm="head"))])
def test_cached_logits_equal_one_full_forward(attn, kw):
    """Teacher forcing: a prefill, then one token at a time across many windows and MoBA blocks,
    gives at every step the logits of one forward over all the tokens (value-rule SA: with the
    keys r the cache drew, one per token and layer)."""
    model, idx = tiny(attn, **kw), tokens(2, TOTAL)
    with torch.no_grad():
        cache = KVCache(model.config)
        got = [model(idx[:, :PROMPT], cache=cache)[0]]
        got += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(PROMPT, TOTAL)]
        want, _ = model(idx, draws=cached_draws(model, cache, 2, TOTAL))     # (2, TOTAL, vocab)
    diff = (torch.cat(got, 1) - want).abs().max().item()
    assert diff <= 1e-5, f"{attn} {kw}: cached logits differ by {diff:.2e}"


@pytest.mark.parametrize("attn", ["full", "swa", "moba"])
def test_greedy_with_cache_equals_without(attn):
    model, idx = tiny(attn), tokens(2, 11)
    a, b = (model.generate(idx, 60, temperature=0, use_cache=c) for c in (True, False))
    assert a.shape == (2, 71) and torch.equal(a, b)


def test_moba_cache_breaks_ties_as_moba_select():
    """With the query weights zeroed every MoBA routing score ties, and which blocks topk picks
    depends on the width of the row it sees. Each cached step must pick the blocks that
    generate without a cache picks: those of a forward over the tokens so far, its last row.
    One layer: under ties moba_select's choice for a row depends on T, so in a deeper model
    the earlier rows of that forward differ from the ones the cache computed, by design."""
    model, idx = tiny("moba", n_layer=1), tokens(2, TOTAL)
    for block in model.transformer.h:
        block.attn.c_attn.weight.data[:model.config.n_embd] = 0
    cache = KVCache(model.config)
    with torch.no_grad():
        model(idx[:, :PROMPT], cache=cache)
        for t in range(PROMPT, TOTAL):
            got, want = model(idx[:, t:t + 1], cache=cache)[0][:, 0], model(idx[:, :t + 1])[0][:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"step {t}: {m}")


def test_past_block_size_the_cache_is_refilled_from_half_a_block():
    """The documented rule (GPT.generate): a full cache is refilled from the last block_size // 2 tokens."""
    model, bs = tiny("swa", block_size=32), 32
    got = model.generate(tokens(1, 20), 50, temperature=0)[0].tolist()
    seq, start = got[:20], 0
    while len(seq) < 70:
        if len(seq) - start > bs:
            start = len(seq) - bs // 2
        seq.append(model(torch.tensor([seq[start:]]))[0][0, -1].argmax().item())
    assert got == seq


def largest_tensor_of_a_decode_step(model, T):
    cache = KVCache(model.config)
    with torch.no_grad():
        model(tokens(1, T), cache=cache)
        with MaxNumel() as seen:
            model(tokens(1, 1), cache=cache)
    return seen.max, cache


def test_swa_decode_is_o_window():
    """SWA's cache holds `window` positions per layer, and a decode step's largest tensor does not
    grow with T (its size is set by the weights); the probe does see full attention's O(T) step."""
    kw = dict(block_size=2048, vocab_size=61, n_layer=2, n_head=2, n_embd=32, window=8)
    swa, full = GPT(GPTConfig(attn="swa", **kw)).eval(), GPT(GPTConfig(attn="full", **kw)).eval()
    (short, _), (long, cache) = (largest_tensor_of_a_decode_step(swa, T) for T in (300, 2000))
    assert all(layer[kv].shape[2] == 8 for layer in cache.layers for kv in ("k", "v"))
    assert short == long, f"a swa decode step made a tensor of {short} elements at T=300, {long} at T=2000"
    assert largest_tensor_of_a_decode_step(full, 2000)[0] >= 2000 * 32 > long


@pytest.mark.parametrize("attn", ["sa", "sa+swa"])
def test_value_sa_decode_reads_o_window_keys(attn, monkeypatch):
    """A cached value-rule SA step reads the keys of the buckets near its r: about 3 * window of
    them at T = block_size, not T (the probe does see full attention read all T)."""
    kw = dict(block_size=2048, vocab_size=61, n_layer=2, n_head=2, n_embd=32, window=8, sa_rule="value")
    read = []
    masked_attention = attention.masked_attention
    monkeypatch.setattr(attention, "masked_attention", lambda q, k, v, m: read.append(k.shape[2]) or masked_attention(q, k, v, m))
    for kind in (attn, "full"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(attn=kind, **kw)).eval()
        cache = KVCache(model.config)
        with torch.no_grad():
            model(tokens(1, 2000), cache=cache)
            read.clear()
            for t in range(20):
                model(tokens(1, 1, seed=t), cache=cache)
        if kind == "full":
            assert min(read) >= 2000
        else:
            assert max(read) <= 8 * 8, f"a decode step read {max(read)} keys with window 8 at T=2000"


@pytest.mark.parametrize("attn", ["sa", "sa+swa"])
def test_sa_cannot_be_cached_says_so_and_recomputes(attn, capsys):
    model, idx = tiny(attn), tokens(1, 11)
    outs = []
    for use_cache in (True, False):
        model.sa_generator.manual_seed(0)
        outs.append(model.generate(idx, 5, temperature=0, use_cache=use_cache))
    err = capsys.readouterr().err
    assert torch.equal(*outs) and err.count("\n") == 1 and "cannot be decoded from a KV cache" in err
    with pytest.raises(ValueError, match="a KV cache takes a cacheable model"):
        KVCache(model.config)
