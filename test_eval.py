"""Tests for eval.py and GPT.from_pretrained, all offline. Run: python -m pytest -q test_eval.py"""
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval as ev
import tasks
import prepare_data
from model import GPT, GPTConfig, save_checkpoint


# -----------------------------------------------------------------------------
# Scoring definitions, on a stand-in model whose every log-probability is known

CYCLE = " abcdefghijklmnopqrstuvwxyz"
HI = 5.0
HIT = -math.log(1 + 255 * math.exp(-HI))   # log-prob of the predicted byte
MISS = HIT - HI                            # log-prob of any other byte


class SuccessorLM:
    """Byte-level: after a character of CYCLE it predicts the next one (after z: space),
    after any other character a space, with logit HI against 0 for the other 255 bytes."""
    block_size, device = 64, "cpu"
    tok = tasks.Tokenizer("bytes", lambda s: list(s.encode()), lambda ids: bytes(ids).decode(), None,
                          lambda s: list(s.encode()))

    def logits(self, idx, lengths=None):
        assert idx.shape[1] <= self.block_size
        nxt = {ord(c): ord(CYCLE[(i + 1) % len(CYCLE)]) for i, c in enumerate(CYCLE)}
        target = torch.tensor([nxt.get(int(t), ord(" ")) for t in idx.flatten()]).view(idx.shape)
        return HI * F.one_hot(target, 256).float()


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return str(path)


LONG = "abcdefghijk" + "q" + "rstuvw" + "c" + "defghijklm"  # 29 characters, 2 mispredicted of 30 tokens


def test_multiple_choice_acc_and_acc_norm(tmp_path):
    docs = [
        # " b": HIT + MISS = -7 beats " " + LONG: 28 HIT + 2 MISS = -40, but per character -40/29 beats -7/1
        {"context": "Question: a\nAnswer:", "choices": ["b", LONG], "label": 1},
        {"context": "Question: b\nAnswer:", "choices": ["abc", "zzz"], "label": 0},   # both right
        {"context": "x", "choices": ["xyz", "abc"], "label": 0},                     # both wrong
    ]
    name, kind, loaded = tasks.load_task_file(write_jsonl(tmp_path / "mc.jsonl", docs))
    assert (name, kind, loaded) == ("mc", "choice", docs)
    lm = SuccessorLM()
    (ll_b, greedy_b), (ll_long, _) = tasks.loglikelihoods(lm, tasks.requests_of(kind, docs[0]), batch_size=2)
    assert ll_b == pytest.approx(HIT + MISS) and not greedy_b
    assert ll_long == pytest.approx(28 * HIT + 2 * MISS)
    m = tasks.evaluate_task(lm, name, kind, loaded, batch_size=4)
    assert m["acc"][0] == pytest.approx(1 / 3) and m["acc_norm"][0] == pytest.approx(2 / 3)
    # the harness's stderr: sample std / sqrt(n); [0, 1, 0] and [1, 1, 0] both give sqrt(1/3) / sqrt(3)
    assert m["acc"][1] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3))
    assert m["acc_norm"][1] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3))


def test_partial_scoring_shares_the_continuation(tmp_path):
    docs = [{"contexts": ["xyz", "hello"], "continuation": "abc", "label": 0},   # " abc" after z: 4 HIT; after o: MISS + 3 HIT
            {"contexts": ["xyz", "hello"], "continuation": "abc", "label": 1}]
    name, kind, loaded = tasks.load_task_file(write_jsonl(tmp_path / "wino.jsonl", docs))
    assert kind == "partial"
    assert tasks.requests_of(kind, docs[0]) == [("xyz", " abc"), ("hello", " abc")]
    m = tasks.evaluate_task(SuccessorLM(), name, kind, loaded, batch_size=3)
    assert m["acc"][0] == 0.5 and "acc_norm" not in m


def test_lambada_greedy_accuracy_and_perplexity(tmp_path):
    docs = [{"text": "xyz abc"},     # " abc": all four bytes predicted: correct
            {"text": "xyz abd"},     # the last byte is not the argmax: wrong
            {"text": "hello cde"}]   # MISS, MISS, HIT, HIT: wrong
    name, kind, loaded = tasks.load_task_file(write_jsonl(tmp_path / "lambada.jsonl", docs))
    assert tasks.requests_of(kind, docs[2]) == [("hello", " cde")]
    m = tasks.evaluate_task(SuccessorLM(), name, kind, loaded, batch_size=2)
    assert m["acc"][0] == pytest.approx(1 / 3)
    assert m["ppl"][0] == pytest.approx(math.exp(-(4 * HIT + (3 * HIT + MISS) + (2 * HIT + 2 * MISS)) / 3))


def test_tokens_split_and_left_truncation():
    tok = SuccessorLM.tok
    assert tasks.encode_pair(tok, "ab ", "c") == ([97, 98], [32, 99])  # the context's trailing space moves over
    lm = SuccessorLM()
    lm.block_size = 6  # "Question: b\nAnswer:" + " abc" is 23 bytes: the model sees the last 6 inputs only
    short = tasks.loglikelihoods(lm, [("Question: b\nAnswer:", " abc")], batch_size=1)
    assert short == [(pytest.approx(4 * HIT), True)]
    with pytest.raises(ValueError, match="block_size"):
        tasks.loglikelihoods(lm, [("x", " abcdefgh")], batch_size=1)
    with pytest.raises(ValueError, match="end-of-text"):
        tasks.encode_pair(tok, "", "abc")


def test_harness_prompt_formats():
    hs = tasks.hellaswag_doc({"activity_label": "Baking", "ctx_a": "A man [header] mixes flour.", "ctx_b": "then he",
                           "endings": ["bakes it [title] well.", "eats it."], "label": "1"})
    assert hs == {"context": "Baking: A man mixes flour. Then he", "choices": ["bakes it. well.", "eats it."], "label": 1}
    arc = tasks.arc_doc({"question": "Why?", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}, "answerKey": "C"})
    assert arc == {"context": "Question: Why?\nAnswer:", "choices": ["a", "b", "c"], "label": 2}
    piqa = tasks.TASKS["piqa"][3]({"goal": "Open a jar", "sol1": "twist", "sol2": "pull", "label": 0})
    assert piqa == {"context": "Question: Open a jar\nAnswer:", "choices": ["twist", "pull"], "label": 0}
    wino = tasks.winogrande_doc({"sentence": "Sam thanked Tom because _ helped him.", "option1": "Sam",
                              "option2": "Tom", "answer": "2"})
    assert wino == {"contexts": ["Sam thanked Tom because Sam", "Sam thanked Tom because Tom"],
                    "continuation": "helped him.", "label": 1}


def test_task_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        tasks.load_task_file(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one two"}\n\n{"text": "three four"\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed"):
        tasks.load_task_file(str(bad))
    for line, why in [('{"context": "q", "choices": ["a", "b"], "label": 2}', "label"),
                      ('{"context": "q", "choices": ["a"], "label": 0}', "at least two"),
                      ('{"question": "q"}', "expected"),
                      ('[1, 2]', "JSON object")]:
        bad.write_text('{"context": "q", "choices": ["a", "b"], "label": 0}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: malformed.*{why}"):
            tasks.load_task_file(str(bad))
    bad.write_text('{"context": "q", "choices": ["a", "b"], "label": 0}\n{"text": "one two"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: a lambada line in a file of choice lines"):
        tasks.load_task_file(str(bad))
    with pytest.raises(ValueError, match="unknown task 'hellaswagg'"):
        ev.run({"tasks": "hellaswagg"})


# -----------------------------------------------------------------------------
# Perplexity and the window sweep, on a tiny byte-level checkpoint

TEXT = "the quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """data_root with a byte-level dataset "tiny" and out_dir with an SWA checkpoint trained on nothing."""
    root = tmp_path_factory.mktemp("run")
    data_root, out_dir = str(root / "data"), str(root / "out")
    meta = prepare_data.write_dataset(os.path.join(data_root, "tiny"), {"train": [TEXT], "val": [TEXT[:203]]},
                                      prepare_data.text_tokenizer("bytes"), source="test")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, attn="swa", window=4))
    os.makedirs(out_dir)
    save_checkpoint({"model": model.state_dict(), "model_args": model.model_args(), "config": {"dataset": "tiny"},
                     "meta": meta}, os.path.join(out_dir, "ckpt.pt"))
    return {"out_dir": out_dir, "data_root": data_root, "model": model.eval(), "device": "cpu", "dtype": "float32"}


def test_perplexity_on_a_prepared_dataset(tiny_run, tmp_path):
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    res = ev.run({**base, "batch_size": 3, "json": str(tmp_path / "ppl.json")})
    got = {r["metric"]: r["value"] for r in res}
    # by hand: windows of 16 inputs at 0, 16, 32, ...; the last one has 202 - 192 = 10 targets
    val = np.frombuffer(TEXT[:203].encode(), np.uint8).astype(np.int64)
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(val) - 1, 16):
            y = torch.from_numpy(val[s + 1:s + 17])
            x = torch.from_numpy(val[s:s + len(y)])
            nll += tiny_run["model"](x[None], y[None])[1].item() * len(y)
            n += len(y)
    assert n == 202
    assert got["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert got["bpb"] == pytest.approx(nll / n / math.log(2), rel=1e-5)  # bytes: one token, one byte
    saved = json.loads((tmp_path / "ppl.json").read_text())
    assert saved["results"][0]["attn"] == "swa" and saved["results"][0]["window"] == 4
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        ev.run({**base, "attn": "sa", "window": 0})
    with pytest.raises(ValueError, match="without training: its gates"):
        ev.run({**base, "attn": "sa+swa"})


def test_window_sweep(tiny_run, tmp_path, capsys):
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    plot = tmp_path / "sweep.png"
    res = ev.run({**base, "windows": "2,16", "seeds": 2, "limit": 4, "plot": str(plot), "json": str(tmp_path / "s.json")})
    ppl = {(r["attn"], r["window"]): r for r in res if r["metric"] == "ppl"}
    assert set(ppl) == {("full", None), ("swa", 2), ("swa", 16), ("sa", 2), ("sa", 16), ("moba", 2), ("moba", 16)}
    full = ppl["full", None]["value"]
    for kind in ("swa", "sa", "moba"):  # a budget of block_size keys is full attention
        assert ppl[kind, 16]["value"] == pytest.approx(full, rel=1e-5)
        assert ppl[kind, 2]["value"] != pytest.approx(full, rel=1e-5)
    assert ppl["sa", 2]["seeds"] == 2 and ppl["sa", 2]["seed_std"] > 0   # SA: mean ± std over seeds
    assert ppl["swa", 2]["seeds"] == 1 and ppl["swa", 2]["seed_std"] is None
    out = capsys.readouterr().out
    assert "tiny/val ppl" in out and out.count("± ") >= 2
    assert plot.stat().st_size > 0
    assert len(json.loads((tmp_path / "s.json").read_text())["per_seed"]) == 3 * (1 + 2 + 2 * 2 + 2)


# -----------------------------------------------------------------------------
# GPT-2's weights in our GPT

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (CI installs it)")


def random_gpt2():
    import transformers
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2,
                                                              n_head=4, bos_token_id=100, eos_token_id=100)).eval()
    with torch.no_grad():  # biases and LayerNorms start at 0 and 1: perturb them so that every copy counts
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf


@needs_transformers
def test_gpt2_import_matches_transformers():
    hf = random_gpt2()
    ours = GPT.from_pretrained(hf).eval()
    assert ours.config.pos_emb == "learned" and ours.config.bias and ours.config.vocab_size == 101
    x = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        want = hf(x).logits
        assert (ours(x)[0] - want).abs().max() < 1e-5
        swa = GPT.from_pretrained(hf, {"attn": "swa", "window": 32}).eval()  # a window of T keys is full attention
        assert (swa(x)[0] - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="can override only"):
        GPT.from_pretrained(hf, {"n_layer": 3})
    with pytest.raises(ValueError, match="unknown GPT-2 model_type"):
        GPT.from_pretrained("gpt3")


def test_missing_packages_are_clear_errors(monkeypatch):
    for name in ("transformers", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    with pytest.raises((SystemExit, ValueError), match="pip install transformers"):  # model.py's own error strategy
        GPT.from_pretrained("gpt2")
    with pytest.raises(ValueError, match="pip install transformers"):
        ev.register_hf_attention("sa", window=4)
    with pytest.raises(ValueError, match="pip install transformers"):
        ev.run({"init_from": "Qwen/Qwen3-0.6B", "tasks": "ppl"})
    with pytest.raises(ValueError, match="pip install datasets, or pass the task as --task_file"):
        tasks.load_task("hellaswag")


# -----------------------------------------------------------------------------
# Our attentions inside a Hugging Face model (a tiny random Qwen3 with grouped-query attention)

@pytest.fixture(scope="module")
def qwen():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    for layer in model.model.layers:  # not 1/sqrt(head_dim): the registered functions must honour the model's scaling
        layer.self_attn.scaling = 0.4
    return model


def hf_logits(model, impl, x, generator=None, seed=0):
    if generator is not None:
        generator.manual_seed(seed)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


@needs_transformers
def test_hf_attention_window_covering_T_is_sdpa(qwen):
    x = torch.randint(0, 97, (2, 20))
    want = hf_logits(qwen, "sdpa", x)
    g = torch.Generator()
    for setting in ({"attn": "swa", "window": 20}, {"attn": "sa", "window": 32}, {"attn": "moba", "moba_block": 8, "moba_topk": 3}):
        got = hf_logits(qwen, ev.register_hf_attention(**setting, generator=g), x, g)
        assert (got - want).abs().max() < 1e-5, setting


@needs_transformers
def test_hf_attention_small_window_is_causal_and_sparse(qwen):
    x = torch.randint(0, 97, (1, 24))
    x2 = x.clone()
    x2[:, 13:] = torch.randint(0, 97, (1, 11))  # new future from position 13 on
    full = hf_logits(qwen, "sdpa", x)
    g = torch.Generator()
    for setting in ({"attn": "swa", "window": 3}, {"attn": "sa", "window": 3}, {"attn": "moba", "moba_block": 4, "moba_topk": 2}):
        name = ev.register_hf_attention(**setting, generator=g)
        a, b = hf_logits(qwen, name, x, g), hf_logits(qwen, name, x2, g)
        assert (a[:, :13] - b[:, :13]).abs().max() < 1e-6, setting   # the past does not see the future
        assert (a[:, 13:] - b[:, 13:]).abs().max() > 1e-3, setting
        assert (a[:, -4:] - full[:, -4:]).abs().max() > 1e-3, setting  # and it is not full attention
    sa = ev.register_hf_attention("sa", window=3, generator=g)
    assert (hf_logits(qwen, sa, x, g, seed=0) - hf_logits(qwen, sa, x, g, seed=1)).abs().max() > 1e-4  # seeds differ


@needs_transformers
def test_hf_attention_decodes_with_a_cache_and_swaps_back(qwen):
    x = torch.randint(0, 97, (1, 10))
    qwen.set_attn_implementation("sdpa")
    lm = ev.HFLM(qwen, SuccessorLM.tok, block_size=None, device="cpu")
    assert lm.block_size == 64
    with torch.no_grad():
        want = qwen.generate(x, max_new_tokens=4, do_sample=False)
        lm.use({"attn": "sa", "window": 16})  # prefill with SA (covering T), then decode against the cache
        assert torch.equal(qwen.generate(x, max_new_tokens=4, do_sample=False), want)
        lm.use({"attn": "full"})
        assert qwen.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="sa\\+swa needs gates"):
        lm.use({"attn": "sa+swa", "window": 4})


@needs_transformers
def test_hf_model_end_to_end(qwen, tiny_run, tmp_path):
    """--init_from=<a Hugging Face model dir>: its own tokenizer (byte-level here) re-reads the dataset's text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32)).save_pretrained(tmp_path)
    res = ev.run({"init_from": str(tmp_path), "data_root": tiny_run["data_root"], "dataset": "tiny", "device": "cpu",
                  "dtype": "float32", "attn": "full,swa,sa", "windows": "4,32", "plot": ""})
    got = {(r["attn"], r["window"], r["metric"]): r["value"] for r in res}
    assert got["full", None, "bpb"] == pytest.approx(got["full", None, "loss"] / math.log(2))  # one byte per token
    for kind in ("swa", "sa"):  # block_size = max_position_embeddings = 32
        assert got[kind, 32, "ppl"] == pytest.approx(got["full", None, "ppl"], rel=1e-5)
        assert got[kind, 4, "ppl"] != pytest.approx(got["full", None, "ppl"], rel=1e-5)
