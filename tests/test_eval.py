"""Tests for eval.py, hf.py and checkpoint.from_gpt2, all offline. Run: python -m pytest -q tests/test_eval.py

- the scoring definitions on hand-built task files with a stand-in model whose log-probabilities
  are known: acc vs acc_norm, partial scoring, stderr and bootstrap stderr, the context/continuation
  split with and without BOS, left truncation, LAMBADA greedy accuracy and perplexity;
- the harness prompt formats of HellaSwag, PIQA, ARC and WinoGrande on sample rows;
- perplexity and bits per byte of a tiny checkpoint against a by-hand loop;
- window sweeps: tables, seeds' mean ± std, plot and JSON placement; budgets covering T equal full;
- SA scores independent of the batch (our GPT and Hugging Face models);
- GPT-2's weight import against a tiny random GPT2LMHeadModel;
- the Hugging Face adapter on tiny random Qwen3/Mistral models: equal to sdpa at budgets covering
  T, left and right padding, no future leakage, SWA decoding with a KV cache equal to
  recomputation and to transformers' own sliding window, unsupported kwargs rejected;
- bf16 and fp16 evaluation of every kind; an sa+swa model's sweep varies both paths' window;
- one-line errors: unknown task, malformed task file (which line), bad windows, missing packages,
  a hub model offline (no retries), read-only and full disks."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import eval as ev
import tasks
import hf

import prepare_data
from checkpoint import from_gpt2, save_checkpoint
from model import GPT, GPTConfig


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
    # " abc" after z: 4 HIT; after o: MISS + 3 HIT
    docs = [{"contexts": ["xyz", "hello"], "continuation": "abc", "label": 0},
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
    assert hs == {"context": "Baking: A man mixes flour. Then he", "choices": ["bakes it. well.", "eats it."],
                  "label": 1}
    arc = tasks.arc_doc({"question": "Why?", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]},
                         "answerKey": "C"})
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
    with pytest.raises(ValueError, match="mean_stderr of no values"):  # was (nan, None), a mean of nothing
        tasks.mean_stderr([])
    with pytest.raises(ValueError, match="tasks='hellaswagg': unknown 'hellaswagg': choose from ppl, lambada"):
        ev.run({"tasks": "hellaswagg"})


def test_a_task_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(b'{"text": "one two"}\n' + '{"text": "caf\xe9 au lait"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:2: not UTF-8 text \(byte 0xe9 at column 14\): "
                                         "save it as UTF-8$"):
        tasks.load_task_file(str(bad))


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
    save_checkpoint({"model": model.state_dict(), "model_args": model.model_args(),
                     "settings": {"dataset": "tiny", "data_root": data_root}, "meta": meta},
                    os.path.join(out_dir, "ckpt.pt"))
    return {"out_dir": out_dir, "data_root": data_root, "model": model.eval(), "device": "cpu", "dtype": "float32"}


def test_perplexity_on_a_prepared_dataset(tiny_run, tmp_path):
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    res = ev.run({**base, "batch_size": 3, "json_out": str(tmp_path / "ppl.json")})
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
    own = ev.run({**base, "data_root": "", "batch_size": 3})  # no data_root: the checkpoint's, not ./data
    assert [r["value"] for r in own] == [r["value"] for r in res]
    with pytest.raises(ValueError, match="window=0: use an integer >= 1"):
        ev.run({**base, "attn": "sa", "window": 0})
    with pytest.raises(ValueError, match="-> 'sa\\+swa' without training: the gates"):
        ev.run({**base, "attn": "sa+swa"})


def test_window_sweep(tiny_run, tmp_path, capsys, monkeypatch):
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    monkeypatch.chdir(tmp_path)  # the repo root of a user: the plot must not land here
    (tmp_path / "res").mkdir()
    res = ev.run({**base, "windows": "2,16", "seeds": 2, "limit": 4, "json_out": str(tmp_path / "res" / "s.json")})
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
    # the plot goes next to --json_out
    assert (tmp_path / "res" / "sweep.png").stat().st_size > 0 and not (tmp_path / "sweep.png").exists()
    assert len(json.loads((tmp_path / "res" / "s.json").read_text())["per_seed"]) == 3 * (1 + 2 + 2 * 2 + 2)


def test_a_swap_takes_every_setting_of_its_kind(tiny_run):
    """eval.py's swap settings are the KINDS rows': sa_rule was none of eval.py's, so value-rule SA could not be
    swapped in. It reaches the model now; a wrong value is one line, from GPTConfig."""
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    ppl = {rule: next(r["value"] for r in ev.run({**base, "attn": "sa", "window": 4, "sa_rule": rule, "limit": 4})
                      if r["metric"] == "ppl") for rule in ("rank", "value")}
    assert ppl["rank"] != pytest.approx(ppl["value"], rel=1e-4)
    with pytest.raises(ValueError, match="GPTConfig.sa_rule='slot' is invalid: must be one of"):
        ev.run({**base, "attn": "sa", "window": 4, "sa_rule": "slot"})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("attn", ["full", "swa", "sa", "moba"])
def test_perplexity_under_autocast(tiny_run, attn, dtype):
    """Every kind evaluates under bf16 and fp16 autocast, close to fp32 (the SA seed fixed)."""
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device")}
    swap = {"attn": attn, **({} if attn == "full" else {"window": 4})}
    if attn == "moba":
        swap["moba_topk"] = 2
    ppl = [next(r["value"] for r in ev.run({**base, **swap, "dtype": d}) if r["metric"] == "ppl")
           for d in ("float32", dtype)]
    assert math.isfinite(ppl[1]) and ppl[1] == pytest.approx(ppl[0], rel=1e-3)  # measured <= 1.5e-4; no attention 3e-3


def test_sa_swa_model_sweeps_both_windows(tiny_run, tmp_path):
    """An sa+swa model keeps its kind: --attn=sa is one clear line, --windows varies both paths' window."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, attn="sa+swa", window=4))
    save_checkpoint({"model": model.state_dict(), "model_args": model.model_args(), "settings": {"dataset": "tiny"},
                     "meta": prepare_data.load_meta(os.path.join(tiny_run["data_root"], "tiny"))},
                    str(tmp_path / "ckpt.pt"))
    base = {"out_dir": str(tmp_path), "data_root": tiny_run["data_root"], "device": "cpu", "dtype": "float32"}
    with pytest.raises(ValueError, match=r"'sa\+swa' -> 'sa' without training: the gates of sa\+swa"):
        ev.run({**base, "attn": "sa", "window": 4})
    res = ev.run({**base, "windows": "1,16", "limit": 4, "plot": ""})
    assert {(r["attn"], r["window"]) for r in res} == {("sa+swa", 1), ("sa+swa", 16)}
    ppl = {r["window"]: r["value"] for r in res if r["metric"] == "ppl"}
    assert ppl[1] != pytest.approx(ppl[16], rel=1e-4)  # the window reaches the model


def test_sweep_plot_labels_only_the_windows():
    plt = prepare_data.pyplot("test")
    fig, ax = plt.subplots()
    ax.plot([16, 32, 64, 128], [1, 2, 3, 4])
    ev.window_ticks(ax, [16, 32, 64, 128])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "32", "64", "128"]
    assert ax.xaxis.get_minorticklocs().size == 0  # log scale's minor labels (2x10^1, 3x10^1...) overlapped them
    plt.close(fig)


def test_unwritable_outputs_are_one_line(tiny_run, tmp_path):
    """A read-only place stops the run before any model loads; a full disk after the tables, in one line."""
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    with pytest.raises(ValueError, match="cannot write to /sys/res/r.json .*Permission denied"):
        ev.run({**base, "out_dir": str(tmp_path / "none"), "json_out": "/sys/res/r.json"})
    with pytest.raises(ValueError, match="cannot write to /sys"):
        ev.run({**base, "out_dir": str(tmp_path / "none"), "windows": "2,4", "plot": "/sys/sweep.png"})
    if os.path.exists("/dev/full"):
        with pytest.raises(ValueError, match="cannot write /dev/full: No space left on device"):
            ev.run({**base, "json_out": "/dev/full"})


def test_bad_devices_checkpoints_and_directories_are_one_line(tiny_run, tmp_path):
    """Before any model loads: a device this machine lacks; a checkpoint without its meta (the tokenizer) or config;
    an --init_from directory that holds no model."""
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    cases = [({"device": "foo"}, "device='foo': use cpu, cuda or cuda:N"),
             ({"dtype": "fp8"}, "dtype='fp8': use one of float32, bfloat16, float16"),
             ({"init_from": str(tmp_path)}, f"--init_from={tmp_path}: the directory holds no model")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "device='cuda': CUDA is not available here"))
    good = torch.load(os.path.join(tiny_run["out_dir"], "ckpt.pt"), weights_only=True)
    for entry in ("meta", "settings"):
        (tmp_path / entry).mkdir()
        torch.save({k: v for k, v in good.items() if k != entry}, tmp_path / entry / "ckpt.pt")
        cases.append(({"out_dir": str(tmp_path / entry)}, f"no '{entry}' entry"))
    for overrides, message in cases:
        with pytest.raises(ValueError) as e:
            ev.run({**base, **overrides})
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    ({"windows": "4,4"}, "windows='4,4': lists 4 twice: give each once"),
    ({"windows": "2, 2"}, "windows='2, 2': lists 2 twice"),
    ({"attn": "swa,swa", "window": 2}, "attn='swa,swa': lists 'swa' twice"),
    ({"tasks": "ppl,ppl"}, "tasks='ppl,ppl': lists 'ppl' twice"),
    ({"task_file": "{a},{a}"}, "task_file='{a},{a}': lists '{a}' twice"),
    ({"task_file": "{a},{b}"}, "task_file='{a},{b}': two tasks are named 'mine' (a task is named after its file)"),
    ({"task_file": "{lambada}", "tasks": "lambada"}, "task_file='{lambada}': two tasks are named 'lambada'"),
    ({"dataset": "../data/tiny"}, "dataset='../data/tiny': use a plain name, no path"),
    ({"json_out": "{dir}"}, "json_out={dir!r}: it is a directory, not a file"),
    ({"windows": "2,4", "plot": "{dir}"}, "plot={dir!r}: it is a directory, not a file"),
    ({"limit": -1}, "limit=-1: use an integer >= 0"),
    ({"seeds": 0}, "seeds=0: use an integer >= 1"),
    ({"batch_size": 0}, "batch_size=0: use an integer >= 1"),
    ({"bootstrap_iters": -5}, "bootstrap_iters=-5: use an integer >= 0"),
    ({"windw": 4}, "windw=4: eval.py has no such setting"),  # was a KeyError traceback
])
def test_settings_that_would_merge_or_lose_results_are_refused_up_front(tiny_run, tmp_path, capsys, overrides, message):
    """Repeats would be averaged as seeds (seed std 0.0000), two tasks of one name would keep one result, a
    dataset path would read elsewhere, an output that is a directory would fail after the run: each is one
    line before anything is evaluated."""
    paths = {"dir": str(tmp_path)}
    for name, path in (("a", "a/mine.jsonl"), ("b", "b/mine.jsonl"), ("lambada", "lambada.jsonl")):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        paths[name] = write_jsonl(tmp_path / path, [{"text": "one two"}])
    overrides = {k: v.format(**paths) if isinstance(v, str) else v for k, v in overrides.items()}
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    with pytest.raises(ValueError) as e:
        ev.run({**base, **overrides})
    assert message.format(**paths) in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert capsys.readouterr().out == ""  # nothing ran


def test_repeated_windows_stop_the_script_with_one_line(tiny_run):
    r = subprocess.run([sys.executable, "eval.py", f"--out_dir={tiny_run['out_dir']}", "--windows=4,4"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in r.stderr.splitlines() if not line.startswith("overriding")]
    assert r.returncode == 1 and lines == ["windows='4,4': lists 4 twice: give each once"], r.stderr
    assert r.stdout == ""


def test_bad_data_and_tokenizers_are_one_line_naming_the_file(tiny_run, tmp_path):
    """A meta.json whose dtype cannot hold token ids (float16 over uint16 data); a checkpoint whose tokenizer
    does not load."""
    data = tmp_path / "data" / "tiny"
    data.mkdir(parents=True)
    src = os.path.join(tiny_run["data_root"], "tiny")
    for f in ("train.bin", "val.bin"):
        (data / f).write_bytes(open(os.path.join(src, f), "rb").read())
    meta = prepare_data.load_meta(src)
    (data / "meta.json").write_text(json.dumps({**meta, "dtype": "float16"}))
    base = {k: tiny_run[k] for k in ("out_dir", "device", "dtype")}
    with pytest.raises(ValueError, match=f"{data / 'meta.json'}: 'dtype' is 'float16', which cannot hold token ids"):
        ev.run({**base, "data_root": str(tmp_path / "data")})
    good = torch.load(os.path.join(tiny_run["out_dir"], "ckpt.pt"), weights_only=True)
    torch.save({**good, "meta": {**meta, "tokenizer": "nope"}}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'ckpt.pt'}: unknown tokenizer 'nope'"):
        ev.run({**base, "out_dir": str(tmp_path), "data_root": tiny_run["data_root"]})


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hub_model_offline_is_one_line_without_retries(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path), OMP_NUM_THREADS="1")  # no hub, an empty cache
    r = subprocess.run([sys.executable, "eval.py", "--init_from=gpt2", "--dataset=tiny"], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "Retrying" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "--init_from=gpt2: cannot load it (the Hugging Face hub is unreachable and it is not in the local "
        "cache); go online once, or give a local path")


# -----------------------------------------------------------------------------
# GPT-2's weights in our GPT

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (CI installs it)")


def random_gpt2():
    import transformers
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2,
                                                                n_head=4, bos_token_id=100, eos_token_id=100)).eval()
    with torch.no_grad():  # biases and LayerNorms start at 0 and 1: perturb them so that every copy counts
        for p in gpt2.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return gpt2


@needs_transformers
def test_gpt2_import_matches_transformers():
    gpt2 = random_gpt2()
    ours = from_gpt2(gpt2).eval()
    assert ours.config.pos_emb == "learned" and ours.config.bias and ours.config.vocab_size == 101
    x = torch.randint(0, 101, (2, 32))
    with torch.no_grad():
        want = gpt2(x).logits
        assert (ours(x)[0] - want).abs().max() < 1e-5
        swa = from_gpt2(gpt2, {"attn": "swa", "window": 32}).eval()  # a window of T keys is full attention
        assert (swa(x)[0] - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="can override only"):
        from_gpt2(gpt2, {"n_layer": 3})
    with pytest.raises(ValueError, match="unknown GPT-2 model"):
        from_gpt2("gpt3")


def test_missing_packages_are_clear_errors(monkeypatch):
    for name in ("transformers", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    with pytest.raises(ValueError, match="pip install transformers"):
        from_gpt2("gpt2")
    with pytest.raises(ValueError, match="pip install transformers"):
        hf.register_hf_attention("sa", window=4)
    with pytest.raises(ValueError, match="pip install transformers"):
        ev.run({"init_from": "Qwen/Qwen3-0.6B", "tasks": "ppl"})
    with pytest.raises(ValueError, match="pip install datasets, or pass hellaswag as --task_file"):
        tasks.load_task("hellaswag")


# -----------------------------------------------------------------------------
# Our attentions inside a Hugging Face model (a tiny random Qwen3 with grouped-query attention)

@pytest.fixture(scope="module")
def qwen():
    import transformers
    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64)
    model = transformers.Qwen3ForCausalLM(hf_config).eval()
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
def test_hf_attention_refuses_settings_it_lacks():
    """An eval.py swap may carry any kind setting; a Hugging Face model's attention takes three (it was a TypeError)."""
    with pytest.raises(ValueError, match="a Hugging Face model's sa takes window, moba_chunk, moba_topk, not sa_rule"):
        hf.register_hf_attention("sa", window=4, sa_rule="value")


@needs_transformers
def test_hf_attention_window_covering_T_is_sdpa(qwen):
    x = torch.randint(0, 97, (2, 20))
    want = hf_logits(qwen, "sdpa", x)
    g = torch.Generator()
    for setting in ({"attn": "swa", "window": 20}, {"attn": "sa", "window": 32},
                    {"attn": "moba", "moba_chunk": 8, "moba_topk": 3}):
        got = hf_logits(qwen, hf.register_hf_attention(**setting, generator=g), x, g)
        assert (got - want).abs().max() < 1e-5, setting


@needs_transformers
def test_hf_attention_small_window_is_causal_and_sparse(qwen):
    x = torch.randint(0, 97, (1, 24))
    x2 = x.clone()
    x2[:, 13:] = torch.randint(0, 97, (1, 11))  # new future from position 13 on
    full = hf_logits(qwen, "sdpa", x)
    g = torch.Generator()
    for setting in ({"attn": "swa", "window": 3}, {"attn": "sa", "window": 3},
                    {"attn": "moba", "moba_chunk": 4, "moba_topk": 2}):
        name = hf.register_hf_attention(**setting, generator=g)
        a, b = hf_logits(qwen, name, x, g), hf_logits(qwen, name, x2, g)
        assert (a[:, :13] - b[:, :13]).abs().max() < 1e-6, setting   # the past does not see the future
        assert (a[:, 13:] - b[:, 13:]).abs().max() > 1e-3, setting
        assert (a[:, -4:] - full[:, -4:]).abs().max() > 1e-3, setting  # and it is not full attention
    sa = hf.register_hf_attention("sa", window=3, generator=g)
    assert (hf_logits(qwen, sa, x, g, seed=0) - hf_logits(qwen, sa, x, g, seed=1)).abs().max() > 1e-4  # seeds differ


@needs_transformers
def test_hf_attention_decodes_with_a_cache_and_swaps_back(qwen):
    x = torch.randint(0, 97, (1, 10))
    qwen.set_attn_implementation("sdpa")
    lm = hf.HFLM(qwen, SuccessorLM.tok, block_size=None, device="cpu")
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
def byte_tokenizer():
    """A transformers tokenizer of the 256 bytes (GPT-2's byte-level alphabet, no merges), built
    offline."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_hf_model_end_to_end(qwen, tiny_run, tmp_path):
    """--init_from=<a Hugging Face model dir>: its own tokenizer (byte-level here) re-reads the dataset's text."""
    import transformers
    byte_tokenizer().save_pretrained(tmp_path)
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


# -----------------------------------------------------------------------------
# lm-eval 0.4.13 parity: BOS, context length, whitespace-only contexts, the LAMBADA ppl stderr

@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory):
    """A local Hugging Face model dir: a byte-level tokenizer that adds BOS "<s>" (id 256) by default,
    as Llama's does, and a tiny random Qwen3 whose own window, 3000, is past lm-eval's default 2048."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    path = tmp_path_factory.mktemp("bos")
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<s>": 256}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>").save_pretrained(path)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=3000)).save_pretrained(path)
    return str(path)


def load_hf(path, **settings):
    return ev.load_model({**ev.DEFAULTS, "init_from": path, "device": "cpu", "dtype": "float32", **settings})[0]


@needs_transformers
def test_hf_context_length_is_the_models_own(bos_model_dir):
    assert load_hf(bos_model_dir).block_size == 3000               # max_position_embeddings, not 2048
    assert load_hf(bos_model_dir, block_size=16).block_size == 16  # --block_size caps it
    assert hf.hf_context_length(types.SimpleNamespace(), 1e30) == 2048  # nothing known: lm-eval's default


@needs_transformers
def test_hf_tokens_get_the_tokenizers_bos(bos_model_dir):
    lm = load_hf(bos_model_dir)
    ids, BOS = lm.tok.encode, 256
    # the tokenizer's default special tokens: BOS before every non-empty context
    assert tasks.encode_pair(lm.tok, "ab ", "cd") == ([BOS] + ids("ab"), ids(" cd"))
    assert tasks.encode_pair(lm.tok, "<s>ab", " c") == ([BOS] + ids("ab"), ids(" c"))  # no second BOS
    # empty context: the prefix token (BOS), then the continuation with no special tokens; a
    # whitespace-only context is scored the same way (lm-eval 0.4.13 gives [BOS] and whole[1:] there too)
    assert tasks.encode_pair(lm.tok, "", " cd") == ([BOS], ids(" cd"))
    assert tasks.encode_pair(lm.tok, "  ", "cd") == ([BOS], ids("  cd"))
    (ll, _), = tasks.loglikelihoods(lm, [("ab", " cd")], batch_size=1)
    x = torch.tensor([[BOS] + ids("ab cd")])
    with torch.no_grad():
        logp = lm.model(x).logits[0, :-1].log_softmax(-1)          # (T-1, vocab)
    assert ll == pytest.approx(logp[-3:].gather(-1, x[0, -3:, None]).sum().item(), abs=1e-5)


def test_whitespace_only_context_is_scored_after_end_of_text():
    tok = tasks.Tokenizer("t", lambda s: list(s.encode()), None, 0, lambda s: list(s.encode()))
    assert tasks.encode_pair(tok, " \n", "ab") == ([0], list(b" \nab"))  # lm-eval 0.4.13 asserts here


def lm_eval_bootstrap_stderr(f, xs, iters):
    """lm-eval 0.4.13's bootstrap_stderr (metrics.py), written out as it runs: rounds of 1000 resamples."""
    import random
    res, m = [], min(1000, iters)
    for i in range(iters // m):
        rnd = random.Random(i)
        res.extend(f(rnd.choices(xs, k=len(xs))) for _ in range(m))
    mu = sum(res) / len(res)
    return math.sqrt(sum((r - mu) ** 2 for r in res) / (len(res) - 1))


def test_lambada_ppl_stderr_is_lm_evals_bootstrap(tmp_path):
    docs = [{"text": t} for t in ("xyz abc", "xyz abd", "hello cde", "a bcd", "q rst")]
    name, kind, loaded = tasks.load_task_file(write_jsonl(tmp_path / "lambada.jsonl", docs))
    m = tasks.evaluate_task(SuccessorLM(), name, kind, loaded, batch_size=2, bootstrap_iters=2000)
    lls = [ll for ll, _ in tasks.loglikelihoods(SuccessorLM(), [tasks.requests_of(kind, d)[0] for d in docs], 2)]
    perplexity = lambda items: math.exp(-sum(items) / len(items))   # lm-eval's perplexity aggregation
    want = lm_eval_bootstrap_stderr(perplexity, lls, 2000)
    assert want > 0 and m["ppl"][1] == pytest.approx(want, rel=1e-9)
    assert tasks.evaluate_task(SuccessorLM(), name, kind, loaded, batch_size=2, bootstrap_iters=0)["ppl"][1] is None


# -----------------------------------------------------------------------------
# The adapter: padding, attention kwargs, decoding with a KV cache

def padded_batch(a, b, side):
    """a (Ta,) and b (Tb,), Tb < Ta, as one batch with b padded on `side`, and its attention mask."""
    pad = torch.zeros(len(a) - len(b), dtype=torch.long)
    x = torch.stack([a, torch.cat([pad, b] if side == "left" else [b, pad])])
    mask = torch.ones_like(x)
    mask[1] = (torch.arange(len(a)) >= len(pad)) if side == "left" else (torch.arange(len(a)) < len(b))
    return x, mask, (slice(len(pad), None) if side == "left" else slice(0, len(b)))


@pytest.mark.parametrize("sa_draw", ["layer", "head"])
def test_our_sa_score_does_not_depend_on_the_batch(sa_draw):
    """SA's permutations covered the padded length, so a document's SA logits moved with the
    batch it was scored in; now each row permutes only its own real tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=16, attn="sa", window=3,
                          sa_draw=sa_draw))
    lm = ev.OurLM(model, None, 32, "cpu", torch.no_grad())
    a, b = torch.randint(64, (2, 30))
    batch = torch.stack([a, torch.cat([b[:11], torch.zeros(19, dtype=torch.long)])])   # row 1: 11 real tokens
    lm.seed(5)
    together = lm.logits(batch, torch.tensor([30, 11]))
    lm.seed(5)
    alone = lm.logits(b[None, :11], torch.tensor([11]))
    assert (together[1, :11] - alone[0]).abs().max() < 1e-5
    for lengths in (torch.tensor([30, 0]), torch.tensor([30]), torch.tensor([30.0, 11.0]), [30, 1]):
        with pytest.raises(ValueError, match=r"^lengths must be a \(B,\)=\(2,\) integer tensor of "
                                             "real tokens per row, 1 <= lengths <= T=30, got"):
            lm.logits(batch, lengths)


@needs_transformers
def test_hf_attention_honours_left_and_right_padding(qwen):
    """Left padding gave wrong logits (transformers passed no mask), and SA's permutation covered the
    pads: now a padded row's real tokens get what the row alone gets, for every kind and seed."""
    torch.manual_seed(1)
    a, b = torch.randint(1, 97, (20,)), torch.randint(1, 97, (11,))
    g = torch.Generator()

    def run(name, x, mask=None, seed=0):
        g.manual_seed(seed)
        qwen.set_attn_implementation(name)
        with torch.no_grad():
            return qwen(input_ids=x, attention_mask=mask, use_cache=False).logits

    for side in ("left", "right"):
        x, mask, real = padded_batch(a, b, side)
        sdpa = run("sdpa", x, mask)
        for setting in ({"attn": "swa", "window": 20}, {"attn": "sa", "window": 20},
                        {"attn": "moba", "moba_chunk": 8, "moba_topk": 3}):   # budgets covering T: sdpa
            got = run(hf.register_hf_attention(**setting, generator=g), x, mask)
            assert (got[1, real] - sdpa[1, real]).abs().max() < 1e-5, (side, setting)
            assert (got[0] - sdpa[0]).abs().max() < 1e-5, (side, setting)
        for setting in ({"attn": "swa", "window": 3}, {"attn": "sa", "window": 3},
                        {"attn": "moba", "moba_chunk": 2, "moba_topk": 2}):   # sparse: as if each row were alone
            name = hf.register_hf_attention(**setting, generator=g)
            got = run(name, x, mask, seed=5)
            assert (got[1, real] - run(name, b[None], seed=5)[0]).abs().max() < 1e-5, (side, setting)
            assert (got[0] - run(name, a[None], seed=5)[0]).abs().max() < 1e-5, (side, setting)


@needs_transformers
def test_sa_score_does_not_depend_on_the_batch(qwen):
    """eval.py's own scoring: one document scored alone and right-padded in a batch, same SA seed."""
    tok = tasks.Tokenizer("ids", lambda s: [int(t) for t in s.split()], None, 0, lambda s: [int(t) for t in s.split()])
    lm = hf.HFLM(qwen, tok, block_size=None, device="cpu")
    lm.use({"attn": "sa", "window": 2})
    short, long = ("5 6 7 8 9 10", " 11 12"), (" ".join(str(i) for i in range(20, 50)), " 51 52")
    lm.seed(0)
    alone = tasks.loglikelihoods(lm, [short], batch_size=2)[0][0]
    lm.seed(0)
    batched = tasks.loglikelihoods(lm, [short, long], batch_size=2)[0][0]
    assert batched == pytest.approx(alone, abs=1e-4)
    qwen.set_attn_implementation("sdpa")


def tiny_hf(arch, **extra):
    """A tiny random transformers model of `arch` ("Gemma2", "Mistral", ...), built from its config."""
    import transformers
    torch.manual_seed(0)
    hf_config = getattr(transformers, f"{arch}Config")(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=8, max_position_embeddings=64, **extra)
    return getattr(transformers, f"{arch}ForCausalLM")(hf_config).eval()


@needs_transformers
def test_hf_attention_rejects_kwargs_it_does_not_implement():
    gemma = tiny_hf("Gemma2")  # its layers pass softcap=50.0
    gemma.set_attn_implementation(hf.register_hf_attention("swa", window=64))
    with pytest.raises(ValueError, match="does not implement softcap=50.0"):
        gemma(input_ids=torch.randint(0, 50, (1, 8)), use_cache=False)


def greedy_with_cache_and_recomputed(model, x, mask, n=5):
    """Greedy generation with a KV cache: its per-step logits, and the same positions recomputed
    without a cache over the whole sequence."""
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        cached = torch.stack(out.logits, 1)                                     # (B, n, vocab)
        full_mask = torch.cat([mask, torch.ones(len(x), n, dtype=mask.dtype)], 1)
        pos = (full_mask.cumsum(1) - 1).clamp(min=0)                            # generate's position ids
        again = model(input_ids=out.sequences, attention_mask=full_mask, position_ids=pos, use_cache=False).logits
    return cached, again[:, x.shape[1] - 1:-1]


@needs_transformers
def test_hf_swa_decoding_attends_to_the_last_window_keys(qwen, capsys):
    torch.manual_seed(2)
    x, mask, _ = padded_batch(torch.randint(1, 97, (9,)), torch.randint(1, 97, (6,)), "left")
    qwen.set_attn_implementation(hf.register_hf_attention("swa", window=3))
    cached, again = greedy_with_cache_and_recomputed(qwen, x, mask)
    assert (cached - again).abs().max() < 1e-4
    # sa and moba decode with full attention over the cache, and say so once
    qwen.set_attn_implementation(hf.register_hf_attention("sa", window=64))
    cached, again = greedy_with_cache_and_recomputed(qwen, x, mask)
    assert (cached - again).abs().max() < 1e-4    # window >= T: SA is full attention, so the fallback is exact
    assert capsys.readouterr().out.count("runs full attention over the cache") == 1
    qwen.set_attn_implementation("sdpa")


@needs_transformers
def test_hf_swa_matches_transformers_own_sliding_window():
    """Mistral with sliding_window=3 in its config, prefill and cached decoding, left-padded batch."""
    mistral = tiny_hf("Mistral", sliding_window=3)
    x, mask, _ = padded_batch(torch.randint(1, 50, (9,)), torch.randint(1, 50, (5,)), "left")
    mistral.set_attn_implementation("sdpa")
    want, _ = greedy_with_cache_and_recomputed(mistral, x, mask)
    mistral.set_attn_implementation(hf.register_hf_attention("swa", window=3))
    got, _ = greedy_with_cache_and_recomputed(mistral, x, mask)
    assert (got - want).abs().max() < 1e-4


@needs_transformers
def test_hf_swa_decoding_refuses_a_cache_shorter_than_its_window():
    mistral = tiny_hf("Mistral", sliding_window=4)  # its cache keeps the last 4 keys per layer
    mistral.set_attn_implementation(hf.register_hf_attention("swa", window=6))
    with pytest.raises(ValueError, match="sliding_window=4"):
        mistral.generate(torch.randint(1, 50, (1, 8)), max_new_tokens=2, do_sample=False, pad_token_id=0)


# -----------------------------------------------------------------------------
# Settings that would do nothing, empty values, missing tokenizers; sample.py's attention settings

def save_tiny(path, tiny_run, **config):
    """An untrained tiny GPT of `config` saved in path, on tiny_run's dataset; eval.py's settings
    for it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, **config))
    meta = prepare_data.load_meta(os.path.join(tiny_run["data_root"], "tiny"))
    save_checkpoint({"model": model.state_dict(), "model_args": model.model_args(),
                     "settings": {"dataset": "tiny"}, "meta": meta}, str(path / "ckpt.pt"))
    return {"out_dir": str(path), "data_root": tiny_run["data_root"], "device": "cpu",
            "dtype": "float32"}


def test_a_setting_without_attn_swaps_the_models_own_kind(tiny_run, tmp_path):
    """--sa_rule=value without --attn printed the rank rule's perplexity under the value rule's
    flag: a setting without --attn now changes the model's own kind, as --attn=<its kind> does."""
    base = save_tiny(tmp_path, tiny_run, attn="sa", window=4)

    def ppl(**settings):
        results = ev.run({**base, "limit": 4, **settings})
        return next(r["value"] for r in results if r["metric"] == "ppl")
    value = ppl(sa_rule="value")
    assert value == pytest.approx(ppl(attn="sa", window=4, sa_rule="value"), rel=1e-6)
    assert value != pytest.approx(ppl(), rel=1e-4)  # the model's own, the rank rule


@pytest.mark.parametrize("overrides, message", [
    ({"sa_rule": "value"}, "sa_rule='value' does nothing on this model's own attention, swa: drop "
                           "it, or swap in a kind that reads it (--attn=sa,sa+swa)"),
    ({"attn": "swa", "window": 2, "sa_rule": "rank"}, "sa_rule='rank' does nothing on --attn=swa"),
    ({"attn": "full,swa", "window": 2, "sa_draw": "head"},
     "sa_draw='head' does nothing on --attn=full,swa"),
    ({"attn": "swa", "window": 2, "moba_topk": 2},
     "moba_topk=2 does nothing on --attn=swa: drop it, or swap in a kind that reads it "
     "(--attn=moba)"),
    ({"attn": "full", "window": 4}, "window=4 does nothing on --attn=full"),
    ({"attn": "full", "windows": "2,4"}, "windows='2,4' does nothing on --attn=full"),
    ({"seeds": 3}, "seeds=3 does nothing on this model's own attention, swa: only SA draws"),
    ({"attn": "moba", "windows": "2,4", "seeds": 2}, "seeds=2 does nothing on --attn=moba"),
    ({"sa_draw": ""}, "sa_draw='': give it a value, or leave it out for the model's own"),
    ({"attn": "sa", "window": 4, "sa_rule": ""}, "sa_rule='': give it a value"),
])
def test_settings_that_would_do_nothing_are_refused(tiny_run, capsys, overrides, message):
    """--sa_draw='' ran with the empty value neither checked nor used, --sa_rule=value on an SWA
    model printed SWA's numbers: a setting that no attention of the run reads is one line, before
    anything is evaluated."""
    base = {k: tiny_run[k] for k in ("out_dir", "data_root", "device", "dtype")}
    with pytest.raises(ValueError) as e:
        ev.run({**base, **overrides})
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert capsys.readouterr().out == ""  # nothing ran


@needs_transformers
def test_a_hf_directory_without_a_tokenizer_is_named(tiny_run, tmp_path):
    """Without tokenizer files transformers builds a tokenizer of one token, which encoded the
    dataset to nothing: "perplexity needs at least 2 tokens, got 0". The missing tokenizer is named
    now."""
    import transformers
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32)).save_pretrained(tmp_path)
    message = rf"^--init_from={re.escape(str(tmp_path))}: no tokenizer there \(no tokenizer.json" \
        r".*save the model's tokenizer in it \(tokenizer.save_pretrained\)$"
    with pytest.raises(ValueError, match=message):
        ev.run({"init_from": str(tmp_path), "data_root": tiny_run["data_root"], "dataset": "tiny",
                "device": "cpu", "dtype": "float32"})


def script(name, *args, **env):
    """Run a script of the repo on the CPU, offline; its CompletedProcess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, name, "--device=cpu", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=repo)


@needs_transformers
def test_sample_from_a_gpt2_directory_reads_its_own_tokenizer(tmp_path):
    """sample.py --init_from=DIR (a saved GPT2LMHeadModel) needed tiktoken's gpt2 file, so the
    network once: it reads the tokenizer saved in DIR now; a DIR without one says to save it."""
    import transformers
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0))
    with_tok, without = tmp_path / "with", tmp_path / "without"
    gpt2.save_pretrained(with_tok)
    byte_tokenizer().save_pretrained(with_tok)
    gpt2.save_pretrained(without)
    (tmp_path / "cache").mkdir()
    offline = dict(TIKTOKEN_CACHE_DIR=str(tmp_path / "cache"), HTTPS_PROXY="http://127.0.0.1:9",
                   HTTP_PROXY="http://127.0.0.1:9")  # no tiktoken file, and no way to fetch one
    args = ["--start=ab", "--num_samples=1", "--max_new_tokens=6", "--temperature=0"]
    r = script("sample.py", f"--init_from={with_tok}", *args, **offline)
    assert r.returncode == 0 and r.stdout.startswith("ab"), r.stderr[-2000:]
    assert r.stdout.count("---------------") == 1
    r = script("sample.py", f"--init_from={without}", *args, **offline)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{without}: tiktoken could not load the 'gpt2' encoding"), last
    assert last.endswith(f"; or save GPT-2's tokenizer in {without} (tokenizer.save_pretrained)")


def test_sample_takes_every_attention_setting(tiny_run):
    """sample.py took attn and window only: --moba_chunk=8 was an unknown setting. Each GPTConfig
    field a swap may change is a setting now, reaching the model (a bad value is GPTConfig's line);
    a field of the model's shape is none."""
    args = ["--start=ab", "--num_samples=1", "--max_new_tokens=4"]
    args.append("--out_dir=" + tiny_run["out_dir"])
    for swap in (["--attn=moba", "--moba_chunk=8", "--moba_topk=2"],
                 ["--attn=sa", "--sa_rule=value", "--window=3"], ["--attn=sa", "--sa_draw=head"]):
        r = script("sample.py", *args, *swap)
        samples = r.stdout.count("---------------")
        assert r.returncode == 0 and samples == 1, (swap, r.stderr[-2000:])
    for swap, message in ((["--attn=sa", "--sa_rule=slot"], "GPTConfig.sa_rule='slot' is invalid"),
                          (["--sa_draw="], "GPTConfig.sa_draw='' is invalid"),
                          (["--n_layer=3"], "unknown setting 'n_layer'")):
        r = script("sample.py", *args, *swap)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and message in last, (swap, r.stderr[-2000:])
