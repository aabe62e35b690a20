"""Tests for GPT.generate (model.py), its KV cache (kv_cache.py) and sample.py.
Run: python -m pytest -q tests/test_generate.py"""
import os
import subprocess
import sys

import pytest
import torch

import attention
import model as M
from kv_cache import KVCache, use_kv_cache
from checkpoint import save_checkpoint
from model import GPT, GPTConfig
from test_attention import MaxNumel

# lengths that are no multiple of the window (7) or the MoBA chunk (8)
PROMPT, TOTAL = 13, 90


def tiny(attn, **kw):
    torch.manual_seed(0)
    args = dict(block_size=96, vocab_size=61, n_layer=2, n_head=2, n_embd=32, window=7, moba_chunk=8, moba_topk=3)
    return GPT(GPTConfig(attn=attn, **{**args, **kw})).eval()


def tokens(B, T, seed=1):
    return torch.randint(61, (B, T), generator=torch.Generator().manual_seed(seed))


VALUE = dict(sa_rule="value")


def step_logits(model, idx, n, **kw):
    """generate's greedy tokens (B, T + n) and the logits each step chose from (n, B, vocab): an untrained model's
    tokens repeat, so the tokens alone tell two decoders apart only by luck."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out[:, -1]))
    try:
        return model.generate(idx, n, temperature=0, **kw), torch.stack(seen)
    finally:
        hook.remove()


def cached_draws(model, cache, B, T):
    """The SA numbers r that a cache holds (sorted, with their positions), as GPT.forward's draws:
    (T,) or (B, nh, T) per layer, in position order."""
    config = model.config
    if "rs" not in cache.layers[0]:
        return None
    r = [torch.zeros_like(layer["rs"]).scatter_(1, layer["ps"], layer["rs"]) for layer in cache.layers]  # (R, T) each
    return [x[0] if config.sa_draw == "layer" else x.view(B, config.n_head, T) for x in r]


@pytest.mark.parametrize("attn,kw", [("full", {}), ("full", dict(pos_emb="learned")), ("swa", {}),
                                     ("swa", dict(pos_emb="learned")), ("swa", dict(window=200)),
                                     ("moba", {}), ("moba", dict(pos_emb="learned")), ("moba", dict(moba_topk=1)),
                                     ("sa", VALUE), ("sa", dict(VALUE, pos_emb="learned")),
                                     ("sa", dict(VALUE, window=200)), ("sa", dict(VALUE, sa_draw="head")),
                                     ("sa+swa", VALUE), ("sa+swa", dict(VALUE, sa_draw="head"))])
def test_cached_logits_equal_one_full_forward(attn, kw):
    """Teacher forcing: a prefill, then one token at a time across many windows and MoBA chunks,
    gives at every step the logits of one forward over all the tokens (value-rule SA: with the
    numbers r the cache drew, one per token and layer)."""
    model, idx = tiny(attn, **kw), tokens(2, TOTAL)
    with torch.no_grad():
        cache = KVCache(model.config)
        got = [model(idx[:, :PROMPT], cache=cache)[0]]
        got += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(PROMPT, TOTAL)]
        want, _ = model(idx, draws=cached_draws(model, cache, 2, TOTAL))     # (2, TOTAL, vocab)
    diff = (torch.cat(got, 1) - want).abs().max().item()
    assert diff <= 1e-5, f"{attn} {kw}: cached logits differ by {diff:.2e}"
    for layer in cache.layers if "rs" in cache.layers[0] else []:  # rs stays sorted, each position once
        assert (layer["rs"].diff(dim=1) >= 0).all() and torch.equal(layer["ps"].sort(1)[0][0], torch.arange(TOTAL))


@pytest.mark.parametrize("attn", ["full", "swa", "moba"])
def test_greedy_with_cache_equals_without(attn):
    """generate with and without the cache: the same logits at every step, so the same tokens."""
    model, idx = tiny(attn), tokens(2, 11)
    (a, logits_a), (b, logits_b) = (step_logits(model, idx, 60, use_cache=c) for c in (True, False))
    assert a.shape == (2, 71) and torch.equal(a, b)
    torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=0)


def test_moba_cache_breaks_ties_as_moba_select():
    """With the query weights zeroed every MoBA routing score ties, and which chunks topk picks
    depends on the width of the row it sees. Each cached step must pick the chunks that
    generate without a cache picks: those of a forward over the tokens so far, its last row.
    One layer: under ties moba_select's choice for a row depends on T, so in a deeper model
    the earlier rows of that forward differ from the ones the cache computed, by design."""
    model, idx = tiny("moba", n_layer=1), tokens(2, TOTAL)
    for layer in model.transformer.h:
        layer.attn.c_attn.weight.data[:model.config.n_embd] = 0
    cache = KVCache(model.config)
    with torch.no_grad():
        model(idx[:, :PROMPT], cache=cache)
        for t in range(PROMPT, TOTAL):
            got, want = model(idx[:, t:t + 1], cache=cache)[0][:, 0], model(idx[:, :t + 1])[0][:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"step {t}: {m}")


def test_past_block_size_the_cache_is_refilled_from_half_a_block():
    """The documented rule (GPT.generate): a full cache is refilled from the last block_size // 2 tokens. Full
    attention reads every key the cache holds, so each step's logits show where the refill started."""
    model, block_size = tiny("full", block_size=32), 32
    got, logits = step_logits(model, tokens(1, 20), 50)
    seq, start = got[0].tolist(), 0
    for step, n in enumerate(range(20, 70)):  # the step that picks token n
        if n - start > block_size:
            start = n - block_size // 2
        with torch.no_grad():
            want = model(torch.tensor([seq[start:n]]))[0][:, -1]
        torch.testing.assert_close(logits[step], want, atol=1e-5, rtol=0, msg=lambda m: f"token {n}: {m}")


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
    """A cached value-rule SA step reads the keys whose r lie near its own: about 2 * window of
    them at T = block_size, not T (the probe does see full attention read all T)."""
    kw = dict(block_size=2048, vocab_size=61, n_layer=2, n_head=2, n_embd=32, window=8, sa_rule="value")
    read = []
    masked_attention = attention.masked_attention
    monkeypatch.setattr(attention, "masked_attention",
                        lambda q, k, v, m: read.append(k.shape[2]) or masked_attention(q, k, v, m))
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


def test_the_cache_message_names_what_keeps_a_kind_from_a_cache(monkeypatch, capsys):
    """A kind with no cache branch in kv_cache.py (a fork's): the messages spoke of its sa_rule, which has nothing to
    do with it."""
    monkeypatch.setattr(M, "ATTNS", M.ATTNS + ("dilated",))
    for attn, named in (("dilated", "attn='dilated'"), ("sa", "attn='sa' with sa_rule='rank'")):
        config = tiny(attn).config
        assert use_kv_cache(config, True) is False
        assert capsys.readouterr().err.startswith(f"{named} cannot be decoded from a KV cache")
        with pytest.raises(ValueError, match=f"a KV cache takes a cacheable model, not {named}$"):
            KVCache(config)


@pytest.mark.parametrize("attn", ["sa", "sa+swa"])
def test_sa_cannot_be_cached_says_so_and_recomputes(attn, capsys):
    model, idx, outs = tiny(attn), tokens(1, 11), []
    for use_cache in (True, False):
        model.seed_sa(0)
        outs.append(step_logits(model, idx, 5, use_cache=use_cache))
    (got, logits), want = outs[0], []  # recomputing the prefix: a forward over all tokens so far, seed 0's draws
    model.seed_sa(0)
    with torch.no_grad():
        for n in range(11, 16):
            want.append(model(got[:, :n])[0][:, -1])
    err = capsys.readouterr().err
    assert torch.equal(got, outs[1][0]) and torch.equal(logits, outs[1][1]) and torch.equal(logits, torch.stack(want))
    assert err.count("\n") == 1 and "cannot be decoded from a KV cache" in err
    with pytest.raises(ValueError, match="a KV cache takes a cacheable model"):
        KVCache(model.config)


# -----------------------------------------------------------------------------
# mixed precision (issue 21 section 1): every kind, both SA rules and both sa_draw modes

EVERY_KIND = [(attn, {}) for attn in ("full", "swa", "moba")] + [
    (attn, dict(sa_rule=rule, sa_draw=draw)) for attn in ("sa", "sa+swa") for rule in ("rank", "value")
    for draw in ("layer", "head")]
CACHEABLE = [(attn, kw) for attn, kw in EVERY_KIND if GPTConfig(attn=attn, **kw).cacheable]


def kind_id(case):
    return "-".join([case[0], *case[1].values()])


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("attn,kw", EVERY_KIND, ids=[kind_id(c) for c in EVERY_KIND])
def test_generate_under_autocast(attn, kw, dtype, use_cache):
    """generate under bf16 and fp16 autocast, past several windows, MoBA chunks and one cache refill."""
    model = tiny(attn, block_size=16, **kw)
    with torch.autocast("cpu", dtype=dtype):
        out = model.generate(tokens(2, 5), 20, temperature=0.8, top_k=10, use_cache=use_cache)
    assert out.shape == (2, 25) and 0 <= out.min() and out.max() < 61


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("attn,kw", CACHEABLE, ids=[kind_id(c) for c in CACHEABLE])
def test_cache_under_autocast_holds_its_dtype_and_matches_a_forward(attn, kw, dtype):
    """The cache holds what autocast produces, and the cached logits equal one forward's under the
    same autocast within a few of its roundings (measured: one bf16 / fp16 ulp of the logits)."""
    model, idx, total = tiny(attn, **kw), tokens(2, 40), 40
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        cache = KVCache(model.config)
        got = [model(idx[:, :PROMPT], cache=cache)[0]]
        got += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(PROMPT, total)]
        want, _ = model(idx, draws=cached_draws(model, cache, 2, total))
    got = torch.cat(got, 1)
    assert got.dtype == want.dtype == dtype and all(layer[kv].dtype == dtype for layer in cache.layers for kv in "kv")
    torch.testing.assert_close(got.float(), want.float(), atol=4 * torch.finfo(dtype).eps, rtol=0)


def test_tiny_temperature_is_greedy_and_a_negative_one_is_refused():
    """temperature=1e-40 used to give `probability tensor contains either inf, nan`."""
    model, idx = tiny("full"), tokens(2, 5)
    greedy = model.generate(idx, 20, temperature=0)
    for t in (1e-40, 1e-300, 5e-324):
        assert torch.equal(model.generate(idx, 20, temperature=t), greedy)
    with pytest.raises(ValueError, match="temperature=-1"):
        model.generate(idx, 1, temperature=-1)


def test_bad_top_k_and_an_empty_prompt_are_refused():
    """top_k=0, top_k=-1 and a prompt of 0 tokens used to end in a traceback from topk or indexing."""
    model, idx = tiny("full"), tokens(2, 5)
    for top_k in (0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"top_k \(None: sample among all tokens\) must be an integer >= 1, "
                           f"got {top_k}"):
            model.generate(idx, 1, top_k=top_k)
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="use a prompt"):
            model.generate(idx[:, :0], 1, use_cache=use_cache)
    assert model.generate(idx, 3, top_k=1).shape == (2, 8)


def test_bad_generate_and_cache_inputs_raise_one_line():
    """Each used to end in a traceback: a float max_new_tokens, temperature "1", a cache fed another batch
    size after its prefill, a value-rule cache given no draws."""
    model, idx = tiny("swa"), tokens(2, 5)
    for n in (1.5, -1, "3", True):
        with pytest.raises(ValueError, match=f"max_new_tokens must be an integer >= 0, got {n!r}"):
            model.generate(idx, n)
    for t in ("1", None, float("nan")):
        with pytest.raises(ValueError, match="temperature=.*: use a number > 0"):
            model.generate(idx, 1, temperature=t)
    cache = KVCache(model.config)
    model(idx, cache=cache)
    with pytest.raises(ValueError, match="this KV cache holds 2 rows, got a batch of 1: start a new cache"):
        model(idx[:1, :1], cache=cache)
    value = tiny("sa", **VALUE)
    with pytest.raises(ValueError, match="r must be a float tensor .* got None"):
        value(idx, cache=KVCache(value.config), draws=[None, None])
    with pytest.raises(ValueError, match="this KV cache was made for another config"):  # was an IndexError
        tiny("swa", n_layer=3)(idx, cache=KVCache(model.config))
    with pytest.raises(ValueError, match="a KV cache takes a model's GPTConfig, got str"):
        KVCache("swa")


@pytest.mark.parametrize("attn,kw", [("full", {}), ("swa", {}), ("moba", {}), ("sa", VALUE), ("sa+swa", VALUE)])
def test_an_empty_batch_generates_an_empty_batch(attn, kw):
    """B = 0 used to end in `cannot reshape tensor of 0 elements`; SDPA answers empty inputs with empty outputs."""
    for use_cache in (True, False):
        out = tiny(attn, **kw).generate(tokens(2, 5)[:0], 4, use_cache=use_cache)
        assert out.shape == (0, 9) and out.dtype == torch.long


def test_a_moba_chunk_past_block_size_is_one_chunk_in_the_cache():
    """--moba_chunk=1000000000 used to allocate a cache of 10^9 cells per layer; past block_size it is one chunk."""
    model, idx = tiny("moba", moba_chunk=10**9), tokens(2, 5)
    with MaxNumel() as seen:
        got, logits = step_logits(model, idx, 20)
    assert seen.max < 10**6
    one_chunk, logits_96 = step_logits(tiny("moba", moba_chunk=96), idx, 20)
    assert torch.equal(got, one_chunk)
    torch.testing.assert_close(logits, logits_96, atol=1e-5, rtol=0)


# -----------------------------------------------------------------------------
# sample.py, on checkpoints of untrained tiny models

def sample(ckpt_dir, *args):
    cmd = [sys.executable, "sample.py", f"--out_dir={ckpt_dir}", "--device=cpu", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def checkpoint(tmp_path, meta, **kw):
    model = tiny(**kw)
    save_checkpoint({"model": model.state_dict(), "model_args": model.model_args(), "meta": meta},
                    str(tmp_path / "ckpt.pt"))
    return tmp_path


def test_sample_rank_sa_says_once_that_it_recomputes(tmp_path):
    """The README's model (rank-rule sa+swa): one line about the cache for three samples, not three;
    and a tiny temperature runs."""
    out = checkpoint(tmp_path, {"tokenizer": "bytes", "vocab_size": 256}, attn="sa+swa", vocab_size=256)
    r = sample(out, "--start=ab", "--num_samples=3", "--max_new_tokens=8", "--temperature=1e-40")
    assert r.stdout.count("---------------") == 3
    assert r.stderr.count("cannot be decoded from a KV cache") == 1


def test_sample_mqar_prints_no_padding_ids(tmp_path):
    """An MQAR model's vocabulary (10 ids) is padded to 61 here: sampling among all of them draws
    padding ids, which decode (get_tokenizer) drops; cached full attention under fp16."""
    out = checkpoint(tmp_path, {"tokenizer": "ids", "vocab_size": 10}, attn="full")
    r = sample(out, "--start=1 2 3", "--num_samples=1", "--max_new_tokens=40", "--temperature=1.0", "--top_k=0",
               "--dtype=float16")
    ids = [int(t) for t in r.stdout.split("---------------")[0].split()]
    assert ids[:3] == [1, 2, 3] and max(ids) < 10 and len(ids) < 43


def test_a_prompt_longer_than_block_size_is_read_from_its_last_block_size_tokens(tmp_path):
    """generate reads the last block_size tokens, as nanoGPT's does, with or without a cache; its door refused a longer
    prompt ("sequence length 40 exceeds block_size 16"), and so did sample.py."""
    model, idx = tiny("swa", block_size=16), tokens(2, 40)
    for use_cache in (True, False):
        long, short = (model.generate(x, 8, temperature=0, use_cache=use_cache) for x in (idx, idx[:, -16:]))
        assert torch.equal(long[:, :40], idx) and torch.equal(long[:, 40:], short[:, 16:])
    out = checkpoint(tmp_path, {"tokenizer": "bytes", "vocab_size": 256}, attn="swa", vocab_size=256)  # block_size 96
    assert sample(out, "--start=" + "ab" * 60, "--num_samples=1", "--max_new_tokens=4").stdout.startswith("ab" * 60)


def rounding_pairs(n, delta=0.125, seed=0):
    """r (2n,) of n pairs (b, a), b first: b - a = delta - 2**-25 < delta (the rule shows b to a), yet fp32's
    a + delta rounds (half to even) down to b itself, so a search to a + delta without a margin misses b."""
    g = torch.Generator().manual_seed(seed)
    b = 0.5 + torch.randperm(2**17, generator=g)[:n].double() * 2**-23  # in [0.5, 0.516), b * 2**24 even
    a = b - delta + 2**-25  # in [0.375, 0.391): exact in fp32
    return torch.stack([b, a], 1).flatten().float()


@pytest.mark.parametrize("draw", ["exact", "rounding"])
def test_value_sa_cache_at_the_edge_of_delta(draw):
    """The cache's step keeps exactly the keys the value rule keeps: pairs at exactly delta (hidden) and pairs whose
    fp32 sum q_r + delta rounds onto the key's r (shown)."""
    T = 32
    model, idx = tiny("sa", sa_rule="value", block_size=64, window=8), tokens(2, T)  # delta = 8 / 64 = 1/8
    r = torch.randperm(T, generator=torch.Generator().manual_seed(0)).float() / T if draw == "exact" \
        else rounding_pairs(T // 2)
    assert model.config.sa_delta == 0.125 and r.unique().numel() == T
    draws = [r] * model.config.n_layer
    with torch.no_grad():
        cache = KVCache(model.config)
        got = [model(idx[:, :4], cache=cache, draws=[d[:4] for d in draws])[0]]
        got += [model(idx[:, t:t + 1], cache=cache, draws=[d[t:t + 1] for d in draws])[0] for t in range(4, T)]
        want, _ = model(idx, draws=draws)
    assert (torch.cat(got, 1) - want).abs().max().item() <= 1e-5
