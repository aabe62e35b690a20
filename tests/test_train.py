"""Tests for prepare_data.py, train.py, sample.py, configurator.py and checkpoint.py.
Run: python -m pytest -q tests/test_train.py. The scripts run as subprocesses on tiny models.

- prepare_data on small inputs, and the downloadable datasets offline through their real code
  with a tiny BPE; MQAR's answers depend on the pairs;
- exact resume: 2N iterations equal N + resume to N, bitwise (dropout, SA, sa_draw=head, grad
  accumulation), also after a simulated kill; log.jsonl cut back to the checkpoint;
- nothing lost: rerunning the main job refuses to overwrite its checkpoint; no save at iter 0 (and
  no false "checkpoint" line); --overwrite keeps the old pair until its first checkpoint, also on a
  full disk; a corrupt log line stops a resume in one line; a resume on another dataset is refused
  even when the padded vocab sizes match; a dataset is never replaced by an empty one, nor left with a
  partial file on a full disk; a second run into a busy out_dir is refused (a killed run's lock goes
  with it); a diverged (NaN) run stops and saves nothing, also under DDP;
- fp16 (GradScaler, exact resume) and bf16 training of every kind;
- a 2-process gloo DDP run; sampling (greedy = top_k 1, seeds reproduce);
- a kind with a setting of its own, written in three places of a copy of the repo, trains, samples and evaluates;
- every bad input (setting names, values, files, checkpoints, datasets) gets one line, a non-zero
  exit, and nothing written."""
import contextlib
import errno
import io
import json
import os
import re
import resource
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile

import numpy as np
import pytest
import tiktoken
import torch
import torch.nn.functional as F

import eval as ev
import tasks
import prepare_data as P

from checkpoint import from_gpt2, load_checkpoint, save_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models; one thread each is fastest on a shared CPU
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--window=8", "--batch_size=4",
        "--gradient_accumulation_steps=2", "--eval_iters=2", "--log_interval=1", "--warmup_iters=2",
        "--device=cpu", "--dtype=float32"]


def run(*cmd, check=True, max_file_bytes=None, timeout=300):
    """Run a repo script (or `-m module ...`) with this Python, from the repo root. max_file_bytes:
    no file it writes may grow past this (RLIMIT_FSIZE), which looks to it like a full disk."""
    cmd = [c if c.startswith("-") or not c.endswith(".py") else os.path.join(REPO, c) for c in map(str, cmd)]
    limit = max_file_bytes and (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes)))
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout,
                       preexec_fn=limit or None)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def one_line_error(monkeypatch, script, *args):
    """Run a repo script in this process (no interpreter start-up: seconds less per case) to its exit,
    which must be a one-line message: returned. A ValueError is what the script's excepthook (configurator.py)
    prints, which must be one line too; any other exception, a traceback, fails the test."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the script's own is dropped afterwards
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except SystemExit as e:
        message = str(e.code)
        assert e.code not in (None, 0), message
    except ValueError as e:
        with contextlib.redirect_stderr(io.StringIO()) as printed:
            sys.excepthook(type(e), e, e.__traceback__)
        message = printed.getvalue()
    else:
        pytest.fail(f"{script} ran to its end")
    assert message.strip() and "\n" not in message.strip(), message
    return message.strip()


def assert_clean_error(r, message):
    """Failed with a one-line message containing `message`, and no traceback."""
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert message in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]


def tiny_encoding(eot):
    """A byte-level BPE with a few merges, standing in for GPT-2's (which would be downloaded)."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"the", b" the", b"in", b"ing"):
        ranks[merge] = len(ranks)
    return tiktoken.Encoding("tiny", pat_str=r" ?\w+| ?[^\w\s]+|\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": eot})


def read_split(data_dir, split, meta):
    return P.get_tokenizer(meta)[1](P.load_tokens(data_dir, split, meta).tolist())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """data_root with `text` (bytes, from this repo's sources), `chars` and `chars2` (two vocabularies
    of 200 characters each, padded to 256 as bytes are) and a small `mqar`."""
    root = tmp_path_factory.mktemp("data")
    src = root / "src.txt"
    src.write_bytes(b"".join(open(os.path.join(REPO, f), "rb").read() for f in ("attention.py", "configurator.py")))
    P.prepare_text(str(root / "text"), str(src), "bytes", 0.1)
    for name, first in (("chars", 0x400), ("chars2", 0x500)):
        (root / f"{name}.txt").write_text("".join(map(chr, range(first, first + 200))) * 6, encoding="utf-8")
        P.prepare_text(str(root / name), str(root / f"{name}.txt"), "chars", 0.1)
    P.prepare_mqar(str(root / "mqar"), seq_len=64, num_pairs=8, num_queries=4, vocab=64,
                   train_seqs=512, val_seqs=64, seed=0)
    return root


@pytest.fixture(scope="module")
def train_args(root):
    return [f"--data_root={root}", "--dataset=text", *TINY, "--dropout=0.1", "--attn=sa+swa",
            "--eval_interval=3", "--lr_decay_iters=6"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_args):
    """out_dir of a 6-iteration SA+SWA run with dropout: every RNG stream is in use."""
    out = tmp_path_factory.mktemp("out") / "full"
    run("train.py", *train_args, "--max_iters=6", f"--out_dir={out}")
    return out


def load(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)


def read_log(out_dir, timing=False):
    """log.jsonl's records; without the timing fields unless timing=True."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        timings = () if timing else ("elapsed_s", "ms_per_iter", "tok_per_s")
        return [{k: v for k, v in json.loads(line).items() if k not in timings} for line in f]


def files(out_dir):
    """{name: bytes} of every file in out_dir."""
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


# -----------------------------------------------------------------------------
# prepare_data.py

def test_prepare_input_file_bytes(tmp_path):
    text = "def f(x):\n    return x  # naïve → ok\n" * 40
    (tmp_path / "notes.txt").write_text(text, encoding="utf-8")
    run("prepare_data.py", f"--input_file={tmp_path / 'notes.txt'}", f"--data_root={tmp_path}")
    meta = P.load_meta(tmp_path / "notes")  # named after the file
    raw = text.encode("utf-8")
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("bytes", 256, "uint16")
    assert meta["tokens"] == {"train": int(len(raw) * 0.9), "val": len(raw) - int(len(raw) * 0.9)}
    train, val = (P.load_tokens(tmp_path / "notes", s, meta) for s in ("train", "val"))
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw  # split at 90%, nothing lost
    encode, decode = P.get_tokenizer(meta)
    assert decode(encode("naïve → ok")) == "naïve → ok"


@pytest.mark.parametrize("eot, dtype", [(50256, "uint16"), (70000, "uint32")])
def test_downloadable_datasets_offline(tmp_path, monkeypatch, eot, dtype):
    """shakespeare_char, fineweb-edu and wikitext-103 through their real code, with the
    network calls and GPT-2's encoding replaced by local stand-ins."""
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiny_encoding(eot))
    monkeypatch.setitem(P.VOCAB, "gpt2", eot + 1)  # the stand-in's vocabulary, as meta.json's check knows gpt2's
    play = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 5
    docs = [f"doc {i}: the thing is in the string" for i in range(12)]
    monkeypatch.setattr(P, "download_text", lambda url: play)
    monkeypatch.setattr(P, "hf_dataset", lambda path, name, split, streaming=False: (
        ({"text": d} for d in docs) if "fineweb" in path else [{"text": f" = {split} =\n"}, {"text": " the line\n"}]))

    meta = P.prepare_shakespeare_char(tmp_path / "sh", 0.1)
    assert meta["vocab_size"] == len(set(play)) and meta["tokenizer"] == "chars"
    assert read_split(tmp_path / "sh", "train", meta) + read_split(tmp_path / "sh", "val", meta) == play

    meta = P.prepare_fineweb_edu(tmp_path / "fw", max_docs=10, val_docs=3)
    assert (meta["vocab_size"], meta["dtype"], meta["eot"]) == (eot + 1, dtype, eot)
    assert read_split(tmp_path / "fw", "val", meta) == "".join(d + "<|endoftext|>" for d in docs[:3])
    assert read_split(tmp_path / "fw", "train", meta) == "".join(d + "<|endoftext|>" for d in docs[3:10])

    meta = P.prepare_wikitext_103(tmp_path / "wt")
    assert read_split(tmp_path / "wt", "test", meta) == " = test =\n the line\n"  # rows joined, no eot
    assert meta["tokens"]["val"] < len(" = validation =\n the line\n")  # BPE merges happened


def test_pystdlib_selection_and_split(tmp_path):
    for f in ("b/a.py", "a.py", "test/t.py", "b/tests/t.py", "idlelib/idle_test/t.py", "site-packages/x/s.py",
              "b/n.txt"):
        (tmp_path / "lib" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib" / f).write_text(f"# {f}\n")
    files = [p.relative_to(tmp_path / "lib").as_posix() for p in P.pystdlib_files(tmp_path / "lib")]
    assert files == ["a.py", "b/a.py"]
    meta = P.prepare_pystdlib(tmp_path / "ds", 0.5, root=tmp_path / "lib")
    assert meta["files"] == {"train": 1, "val": 1}
    assert read_split(tmp_path / "ds", "val", meta) == "# b/a.py\n"  # whole files

    stdlib = P.pystdlib_files(sysconfig.get_paths()["stdlib"])  # the real one: sorted, no tests
    names = [p.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for p in stdlib]
    assert len(names) > 300 and names == sorted(names) and "os.py" in names
    assert not any(set(n.split("/")[:-1]) & P.EXCLUDED_DIRS for n in names)


def test_mqar_answers_come_from_the_earlier_pairs(root):
    meta = P.load_meta(root / "mqar")
    m = meta["mqar"]
    T, Q = m["seq_len"], m["num_queries"]
    train = np.asarray(P.load_tokens(root / "mqar", "train", meta), np.int64).reshape(-1, T)  # (N, T)
    fresh = P.mqar_batch(np.random.default_rng(1), len(train), meta)                          # what train.py makes
    for x, y in ((train, P.mqar_targets(train, meta)), fresh):
        assert ((y != -1).sum(1) == Q).all() and (y[:, :T // 2] == -1).all()
        assert len({tuple(np.nonzero(t != -1)[0]) for t in y}) > len(y) // 2  # queries at varied positions
        assert all(len(set(seq[tgt != -1])) == Q for seq, tgt in zip(x, y))  # a different pair per query (Q <= P)
        by_cue = {}
        for seq, tgt in zip(x, y):
            pairs = dict(zip(seq[0:2 * m["num_pairs"]:2], seq[1:2 * m["num_pairs"]:2]))
            where = {k: 2 * i + 1 for i, k in enumerate(seq[0:2 * m["num_pairs"]:2])}
            assert not set(seq[2 * m["num_pairs"]:]) & set(pairs.values())  # the values never reappear
            for t in np.nonzero(tgt != -1)[0]:
                assert tgt[t] == pairs[seq[t]]  # the value paired with the queried cue
                assert t - where[seq[t]] >= m["min_gap"] > 2 * (8 - 1)  # beyond a 2-layer window-8 SWA's reach
                by_cue.setdefault(seq[t], []).append(tgt[t])
        # the cue alone says little: guessing each cue's most frequent answer is near chance
        cue_only = sum(np.bincount(v).max() for v in by_cue.values()) / sum(len(v) for v in by_cue.values())
        assert cue_only < 0.2
    val = np.asarray(P.load_tokens(root / "mqar", "val", meta)).reshape(-1, T)
    assert not (val[:8] == train[:8]).all() and not (fresh[0][:8] == train[:8]).all()  # each its own stream


# -----------------------------------------------------------------------------
# train.py

def test_resume_is_bitwise_exact(trained, train_args, tmp_path):
    """6 iterations == 3 iterations, then resumed to 6 (dropout and SA permutations included). The 3
    iterations --overwrite another run's out_dir; the resume meets what a kill after them leaves:
    log records past the checkpoint, blank lines, half a line, a half-written ckpt.pt.tmp. The log ends as one run's."""
    for name, content in files(trained).items():
        (tmp_path / name).write_bytes(content)
    run("train.py", *train_args, "--max_iters=3", f"--out_dir={tmp_path}", "--overwrite=True")
    half = load(tmp_path)
    assert [r["iter"] for r in read_log(tmp_path) if "val_loss" in r] == [0, 3]  # the other run's log is gone
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write('\n{"iter": 4, "loss": 9.0, "lr": 0.1}\n{"iter": 4, "train_loss": 9.0, "val_loss": 9.0}\n\n'
                '{"iter": 5, "lo')
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"half a checkpoint")
    r = run("train.py", *train_args, "--max_iters=6", f"--out_dir={tmp_path}", "--init_from=resume")
    assert read_log(tmp_path) == read_log(trained) and not (tmp_path / "ckpt.pt.tmp").exists()
    a, b = load(tmp_path), load(trained)
    assert a["iter_num"] == b["iter_num"] == 6 and half["iter_num"] == 3
    assert any(not torch.equal(half["model"][k], b["model"][k]) for k in b["model"])
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for s, t in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
    for name in ("torch", "sampler", "sa"):
        assert torch.equal(a["rng"][0][name], b["rng"][0][name])
    assert "step 3: train loss" in r.stdout  # the resumed run re-evaluates where it left off


def test_a_resume_past_an_eval_the_longer_run_skips_logs_and_keeps_what_it_does(trained, train_args, tmp_path):
    """Issue 56's case, scaled: stop at 300 with eval_interval 250 (its last eval, at 300, is one a run to 600 never
    makes), then resume to 600. Here 4 with eval_interval 3, then 6: the log and best_val_loss are those of the run of
    6 that never stopped. The stopped checkpoint's best_val_loss is set to 0.0, as if its eval at 4, which the resume
    deletes, had been the best (on this data the loss falls through 6): it used to survive the resume."""
    run("train.py", *train_args, "--max_iters=4", f"--out_dir={tmp_path}")
    assert [r["iter"] for r in read_log(tmp_path) if "val_loss" in r] == [0, 3, 4]
    torch.save({**load(tmp_path), "best_val_loss": 0.0}, tmp_path / "ckpt.pt")
    run("train.py", *train_args, "--max_iters=6", f"--out_dir={tmp_path}", "--init_from=resume")
    assert read_log(tmp_path) == read_log(trained)
    best = min(r["val_loss"] for r in read_log(trained) if "val_loss" in r)
    assert load(tmp_path)["best_val_loss"] == load(trained)["best_val_loss"] == best


def test_a_resume_trains_with_its_own_dropout(trained, train_args, tmp_path):
    """check_resume lets a resume change dropout, as nanoGPT's does; the model kept the checkpoint's, silently, and the
    next checkpoint said one dropout in its settings, another in its model_args."""
    for name, content in files(trained).items():
        (tmp_path / name).write_bytes(content)
    run("train.py", *train_args, "--dropout=0.0", "--max_iters=7", f"--out_dir={tmp_path}", "--init_from=resume")
    ckpt = load(tmp_path)
    assert ckpt["iter_num"] == 7 and ckpt["model_args"]["dropout"] == ckpt["settings"]["dropout"] == 0.0


def test_checkpoint_contents(trained, root):
    ckpt = load(trained)
    assert ckpt["settings"]["dataset"] == "text" and ckpt["settings"]["data_root"] == str(root)
    assert ckpt["settings"]["attn"] == "sa+swa"
    assert ckpt["meta"] == P.load_meta(root / "text") and ckpt["model_args"]["vocab_size"] == 256
    log = read_log(trained, timing=True)
    evals = [r for r in log if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 3, 6]
    assert [r["iter"] for r in log if "val_loss" not in r] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "lr", "tok_per_s", "elapsed_s"} <= r.keys() and r["mfu"] is None  # no mfu on a CPU
               for r in log if "val_loss" not in r)


def test_ddp_two_processes_gloo(root, tmp_path):
    r = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
            f"--data_root={root}", "--dataset=text", *TINY, "--max_iters=2", "--eval_interval=2",
            f"--out_dir={tmp_path}")
    assert "(2 x 1 x 4 x 64)" in r.stdout  # the 2 accumulation steps are split over the 2 ranks
    ckpt = load(tmp_path)
    assert ckpt["iter_num"] == 2 and len(ckpt["rng"]) == 2
    for name in ("sampler", "sa"):  # each rank its own data and its own SA permutations
        assert not torch.equal(ckpt["rng"][0][name], ckpt["rng"][1][name])


def test_a_resume_onto_more_ranks_gives_each_new_rank_its_own_sa_draws(root, tmp_path):
    """One process trains; three resume. The ranks the checkpoint has no states for start from their own seeds
    (seed and rank): no two draw the same SA permutations."""
    job = [f"--data_root={root}", "--dataset=text", *TINY, "--eval_interval=2", f"--out_dir={tmp_path}",
           "--gradient_accumulation_steps=3"]
    run("train.py", *job, "--max_iters=2")
    r = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "train.py", *job,
            "--init_from=resume", "--max_iters=4")
    assert "rank 2: the checkpoint has RNG states for fewer ranks" in r.stdout
    sa = [s["sa"] for s in load(tmp_path)["rng"]]
    assert len(sa) == 3 and not any(torch.equal(sa[i], sa[j]) for i, j in ((0, 1), (0, 2), (1, 2)))


def test_mqar_training_reports_answer_accuracy(root, tmp_path):
    r = run("train.py", f"--data_root={root}", "--dataset=mqar", *TINY, "--attn=swa", "--max_iters=2",
            "--eval_interval=2", f"--out_dir={tmp_path}")
    assert "SWA's reach 2 x (8 - 1) < min_gap" in r.stdout and "val_acc" in r.stdout
    evals = [json.loads(line) for line in open(tmp_path / "log.jsonl") if "val_acc" in line]
    assert len(evals) == 2 and all(0 <= e["val_acc"] <= 1 for e in evals)


def test_rerunning_the_main_job_loses_nothing(root, tmp_path):
    """config/quick.py twice into one out_dir: the second run stops at once and changes nothing.
    A run of 0 iterations saves no checkpoint: nanoGPT's rule, the untrained model is worth nothing."""
    job = ["train.py", "config/quick.py", f"--data_root={root}", "--dataset=text", *TINY, f"--out_dir={tmp_path}"]
    for extra in (["--max_iters=0"], ["--eval_only=True"]):
        done = run(*job, *extra, "--eval_interval=2").stdout.strip().splitlines()[-1]
        assert done.endswith("this run saved no checkpoint") and "ckpt.pt" not in done
        assert not (tmp_path / "ckpt.pt").exists()
    done = run(*job, "--max_iters=2", "--eval_interval=2").stdout.strip().splitlines()[-1]
    assert done.endswith(f"checkpoint {tmp_path / 'ckpt.pt'} (iteration 2)")
    before = files(tmp_path)
    for extra in ([], ["--eval_only=True"]):
        assert_clean_error(run(*job, "--max_iters=2", "--eval_interval=2", *extra, check=False),
                           "ckpt.pt exists: continue it with --init_from=resume, train in a new --out_dir, "
                           "or replace it")
    assert files(tmp_path) == before


def test_overwrite_keeps_the_old_pair_until_its_first_checkpoint(trained, train_args, tmp_path):
    """--overwrite=True that saves nothing (0 iterations), or dies writing its first checkpoint
    (a full disk), leaves the old ckpt.pt and log.jsonl as they were; test_resume_is_bitwise_exact
    covers the replacement."""
    for name, content in files(trained).items():
        (tmp_path / name).write_bytes(content)
    before = files(tmp_path)
    job = ["train.py", *train_args, f"--out_dir={tmp_path}", "--overwrite=True"]
    done = run(*job, "--max_iters=0").stdout.strip().splitlines()[-1]
    assert done.endswith(f"saved no checkpoint; the old {tmp_path / 'ckpt.pt'} is kept")
    assert files(tmp_path) == before
    r = run(*job, "--max_iters=3", check=False, max_file_bytes=50_000)  # the log fits, the checkpoint does not
    assert_clean_error(r, f"cannot write {tmp_path / 'ckpt.pt'}")
    assert "this run saved no checkpoint" in r.stderr and "step 3: train loss" in r.stdout
    assert files(tmp_path) == before


def test_resume_stops_at_a_corrupt_log_line(trained, train_args, tmp_path):
    for name, content in files(trained).items():
        (tmp_path / name).write_bytes(content)
    lines = (tmp_path / "log.jsonl").read_text().splitlines(keepends=True)
    for bad, shown in (("oops, not JSON\n", "'oops, not JSON'"), ("caf\xe9\n", "'caf\ufffd'"),  # Latin-1: a traceback
                       ('{"iter": 1, "note": "caf\xe9"}\n', "'{\"iter\": 1, \"note\": \"caf\ufffd\"}'")):  # was read as UTF-8
        text = "".join(lines[:2]).encode() + bad.encode("latin-1") + "".join(lines[2:]).encode()
        (tmp_path / "log.jsonl").write_bytes(text)
        before = files(tmp_path)
        r = run("train.py", *train_args, "--max_iters=8", f"--out_dir={tmp_path}", "--init_from=resume", check=False)
        assert_clean_error(r, f"{tmp_path / 'log.jsonl'}:3 is not a log record ({shown})")
        assert files(tmp_path) == before


def test_a_diverged_run_stops_and_keeps_the_last_checkpoint(trained, train_args, root, tmp_path):
    """A NaN training or eval loss stops the run in one line naming the iteration; nothing of it is saved."""
    r = run("train.py", f"--data_root={root}", "--dataset=text", *TINY, "--learning_rate=1e30", "--max_iters=4",
            f"--out_dir={tmp_path / 'new'}", check=False)
    assert_clean_error(r, "iteration 1: the training loss is nan: the run diverged (lower --learning_rate?); "
                          "this run saved no checkpoint")
    assert not (tmp_path / "new" / "ckpt.pt").exists()
    for name, content in files(trained).items():  # resumed at 6 (past lr_decay_iters: min_lr): iteration 6 blows
        (tmp_path / name).write_bytes(content)  # the weights up, and 7's eval sees it
    r = run("train.py", *train_args, "--learning_rate=1e30", "--min_lr=1e30", "--max_iters=9", "--eval_interval=1",
            "--init_from=resume", f"--out_dir={tmp_path}", check=False)
    assert_clean_error(r, "iteration 7: the eval's train + val loss is nan: the run diverged")
    assert f"{tmp_path / 'ckpt.pt'} holds iteration 6" in r.stderr  # the checkpoint it resumed from, saved again
    kept, good = load(tmp_path), load(trained)  # the resumed run saved iteration 6 again, and nothing after it
    assert kept["iter_num"] == 6 and all(torch.equal(v, good["model"][k]) for k, v in kept["model"].items())
    assert "NaN" not in (tmp_path / "log.jsonl").read_text()


@pytest.mark.parametrize("eval_interval, what", [(1000, "training loss"), (1, "eval's train + val loss")])
def test_ddp_ranks_stop_together_when_the_loss_diverges(root, tmp_path, eval_interval, what):
    """Under DDP every rank stops at the same iteration, also when only the master's eval sees the NaN:
    no rank waits forever on a stopped one."""
    r = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", f"--data_root={root}",
            "--dataset=text", *TINY, "--learning_rate=1e30", "--max_iters=4", f"--eval_interval={eval_interval}",
            f"--out_dir={tmp_path}", check=False, timeout=120)
    assert r.returncode != 0 and f"iteration 1: the {what} is nan" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "ckpt.pt").exists()


def test_a_second_run_into_one_out_dir_is_refused(root, tmp_path):
    """While one run holds out_dir, a second is refused in one line; a SIGKILLed run leaves no stale lock."""
    job = ["train.py", f"--data_root={root}", "--dataset=text", *TINY, f"--out_dir={tmp_path}", "--eval_interval=1000"]
    cmd = [sys.executable, os.path.join(REPO, "train.py"), *job[1:], "--max_iters=100000"]
    first = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until it trains: its log is open, so it holds the lock
            if (tmp_path / "log.jsonl").exists() and (tmp_path / "log.jsonl").stat().st_size:
                break
            assert first.poll() is None
            time.sleep(0.1)
        r = run(*job, "--max_iters=2", check=False)
        assert_clean_error(r, f"out_dir={tmp_path} is in use by another train.py run")
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
    done = run(*job, "--max_iters=2", "--eval_interval=2").stdout.strip().splitlines()[-1]
    assert done.endswith(f"checkpoint {tmp_path / 'ckpt.pt'} (iteration 2)")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("attn", ["full", "swa", "sa", "sa+swa", "moba"])
def test_trains_under_autocast(root, tmp_path, attn, dtype):
    """Every kind trains under fp16 (with a GradScaler, its state in the checkpoint) and bf16 autocast."""
    run("train.py", f"--data_root={root}", "--dataset=text", *TINY, f"--attn={attn}", f"--dtype={dtype}",
        "--moba_chunk=8", "--moba_topk=2", "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}")
    ckpt = load(tmp_path)
    assert ckpt["iter_num"] == 2 and ckpt["settings"]["dtype"] == dtype
    assert bool(ckpt["scaler"]) == (dtype == "float16") and all(torch.isfinite(v).all() for v in ckpt["model"].values())


@pytest.mark.slow  # about 80 s per kind: Inductor compiles C++ on the CPU
@pytest.mark.parametrize("attn", ["full", "swa", "sa", "sa+swa", "moba"])
def test_compiled_training_logs_eager_losses(root, tmp_path, attn):
    """train.py --compile=True (Inductor) trains every kind with eager's losses, within 1e-4 over 5 iterations."""
    job = ["train.py", f"--data_root={root}", "--dataset=text", *TINY, f"--attn={attn}", "--moba_chunk=8",
           "--moba_topk=2", "--max_iters=5", "--eval_interval=5"]
    for compiled in (False, True):
        run(*job, f"--compile={compiled}", f"--out_dir={tmp_path / str(compiled)}", timeout=1800)
    eager, compiled = ([r["loss"] for r in read_log(tmp_path / str(c)) if "loss" in r] for c in (False, True))
    assert len(eager) == 5 and compiled == pytest.approx(eager, abs=1e-4)


def test_fp16_resume_is_exact(root, tmp_path):
    """4 fp16 iterations == 2, then resumed to 4: the loss scale and its growth tracker resume too."""
    job = ["train.py", f"--data_root={root}", "--dataset=text", *TINY, "--attn=full", "--dtype=float16",
           "--eval_interval=2", "--lr_decay_iters=4"]
    run(*job, "--max_iters=4", f"--out_dir={tmp_path / 'a'}")
    run(*job, "--max_iters=2", f"--out_dir={tmp_path / 'b'}")
    run(*job, "--max_iters=4", f"--out_dir={tmp_path / 'b'}", "--init_from=resume")
    a, b = load(tmp_path / "a"), load(tmp_path / "b")
    assert a["scaler"] == b["scaler"] and a["scaler"]["_growth_tracker"] > 2  # 4 steps without overflow
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_mqar_config_without_data_names_its_prepare_line(tmp_path):
    """config/mqar.py with no data: the hint's command makes the data that config trains on."""
    job = ["train.py", "config/mqar.py", f"--data_root={tmp_path}", f"--out_dir={tmp_path / 'out'}"]
    r = run(*job, check=False)
    assert_clean_error(r, "prepare the dataset first with `python prepare_data.py --dataset=mqar "
                          f"--data_root={tmp_path}`")
    header = "".join(open(os.path.join(REPO, "config", "mqar.py")).readlines()[:2])
    assert "python prepare_data.py --dataset=mqar " in header
    run("prepare_data.py", "--dataset=mqar", f"--data_root={tmp_path}", "--mqar_train_seqs=64", "--mqar_val_seqs=64")
    assert "val_acc" in run(*job, "--max_iters=1", "--eval_interval=1", "--eval_iters=1").stdout


@pytest.mark.parametrize("args, message", [
    (["--out_dir=README.md"], "out_dir='README.md': it is a file"),
    (["--out_dir=/sys/out"], "cannot write to /sys/out (Permission denied in /sys)"),
    (["--eval_interval=0"], "eval_interval=0: use an integer >= 1"),
    (["--log_interval=0"], "log_interval=0: use an integer >= 1"),
    (["--eval_iters=0"], "eval_iters=0: use an integer >= 1"),
    (["--batch_size=0"], "batch_size=0: use an integer >= 1"),
    (["--gradient_accumulation_steps=0"], "gradient_accumulation_steps=0: use an integer >= 1"),
    pytest.param(["--device=cuda"], "device='cuda': CUDA is not available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
    (["--init_from=pretrained"], "unknown GPT-2 model 'pretrained': use one of gpt2"),
    (["--attn_engine=cuda"], "attn_engine='cuda': use one of auto, torch, triton, dense"),
    (["--rope_base=0"], "rope_base=0.0: use a number > 1"),
    (["--rope_base=-10000"], "rope_base=-10000.0: use a number > 1"),
    (["--learning_rate=-1e-3"], "learning_rate=-0.001: use a value > 0"),
    (["--learning_rate=1e308"], "learning_rate=1e+308: use a value > 0 that fp32 holds"),  # was an overflow in AdamW
    (["--batch_size=1000000000000"], "batch_size=1000000000000: 1000000000000 sequences of 64 tokens need"),  # OOM
    (["--min_lr=-1e-5"], "min_lr=-1e-05: use a value from 0 to learning_rate"),
    (["--weight_decay=-0.1"], "weight_decay=-0.1: use a value >= 0"),
    (["--warmup_iters=-1"], "warmup_iters=-1: use an integer >= 0"),
    (["--lr_decay_iters=-1"], "lr_decay_iters=-1: use an integer >= 0"),
    (["--lr_decay_iters=abc"], "lr_decay_iters must be of type int (like 5000), got 'abc'"),
    (["--max_iters=-1"], "max_iters=-1: use an integer >= 0"),
    (["--seed=-1"], "seed=-1: use an integer >= 0"),
    (["--beta1=1.5"], "beta1=1.5: AdamW's betas lie in [0, 1)"),
    (["--beta2=-0.5"], "beta2=-0.5: AdamW's betas lie in [0, 1)"),
    (["--device=tpu"], "device='tpu': use cpu, cuda or cuda:N"),
    (["--dtype=float8"], "dtype='float8': use one of float32, bfloat16, float16"),
    (["--dataset=nope"], "prepare_data.py --input_file=FILE --dataset=nope"),
    (["--block_size=100000"], "is larger than the data"),
    (["--attn=dense"], "GPTConfig.attn='dense' is invalid"),
    (["--learning_rate=1e999"], "learning_rate=inf: use a finite number"),
    (["--beta2=-1e999"], "beta2=-inf: use a finite number"),
    (["--n_layer=1000000", "--n_embd=768"], "n_layer=1000000, n_embd=768, vocab_size=256: 7,077.9B parameters need "
     "105,469 GiB"),
    (["--vocab_size=1000000000"], "vocab_size=1000000000: 32.0B parameters need"),  # spoke of n_layer and n_embd only
    (["--out_dir="], "out_dir='': name a directory"),
])
def test_train_errors(root, tmp_path, monkeypatch, args, message):
    """One line, and nothing written."""
    out = tmp_path / "out"
    assert message in one_line_error(monkeypatch, "train.py", f"--data_root={root}", "--dataset=text", *TINY,
                                     f"--out_dir={out}", *args)
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--dataset="], "dataset='': use a plain name, no path"),
    (["--dataset=../text"], "dataset='../text': use a plain name, no path"),
    (["--dataset=/tmp"], "dataset='/tmp': use a plain name, no path"),
    # the model's settings are GPTConfig's to check, before any data is read (this dataset does not exist)
    (["--dataset=nope", "--rope_base=0"], "rope_base=0.0: use a number > 1"),
    (["--dataset=nope", "--n_head=3"], "GPTConfig.n_embd=32 is invalid: must be divisible by n_head=3"),
    (["--dataset=nope", "--attn=dense"], "GPTConfig.attn='dense' is invalid"),
    (["--dataset=nope", "--rope_base=1e-300"], "rope_base=1e-300: use a number > 1"),  # was "the run diverged"
    (["--dataset=nope", "--vocab_size=-1"], "vocab_size=-1: use an integer >= 0"),
    (["--dataset=nope", "--backend=foo"], "backend='foo': use"),
])
def test_settings_are_checked_before_any_data_is_read(root, tmp_path, monkeypatch, args, message):
    """One line naming the setting, not a misleading one about the data or a diverged run; nothing written."""
    out = tmp_path / "out"
    got = one_line_error(monkeypatch, "train.py", f"--data_root={root}", "--dataset=text", *TINY, f"--out_dir={out}",
                         *args)
    assert message in got and "prepare" not in got and "diverged" not in got, got
    assert not out.exists()


DILATED = [  # a kind with a setting of its own: (file, the line it follows, "" = the end; text)
    ("attention.py", "", """
def dilated_window_attention(q, k, v, window, dilation):
    \"\"\"SWA over every dilation-th key: query i sees i, i - dilation, ..., window keys in all.\"\"\"
    i = torch.arange(q.shape[2], device=q.device)
    gap = i[:, None] - i[None, :]  # (T, T)
    return masked_attention(q, k, v, (gap >= 0) & (gap % dilation == 0) & (gap < window * dilation))
"""),
    ("model.py", '        if kind == "moba":\n            return attention.moba_attention(q, k, v, c.moba_chunk, c.moba_topk)\n',
     """        if kind == "dilated":
            return attention.dilated_window_attention(q, k, v, c.window, c.dilation)
"""),
    ("model.py", 'ATTNS = ("full", "swa", "sa", "sa+swa", "moba"', ', "dilated"'),
    ("model.py", "    rope_base: float = 10000.0\n", "    dilation: int = 2  # the dilated window's step between keys\n"),
]


def test_a_kind_with_its_own_setting_is_three_edits(root, tmp_path):
    """A dilated window is its function in attention.py, its branch in model.py (CausalSelfAttention.attend, and its
    name in ATTNS) and its GPTConfig field, written into a copy of the repo. Then train.py trains it with --dilation
    (a bad one: one line), sample.py samples it (no KV cache: it recomputes the prefix) and eval.py swaps it in at
    another dilation (1, with a window of block_size: full attention's perplexity)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in os.listdir(REPO):
        if name.endswith(".py"):
            shutil.copy(os.path.join(REPO, name), repo / name)
    for name, anchor, text in DILATED:
        old = (repo / name).read_text()
        assert not anchor or old.count(anchor) == 1, f"{name}: the line {anchor!r} moved: update DILATED"
        (repo / name).write_text(old.replace(anchor, anchor + text) if anchor else old + text)

    def script(*args):
        return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=repo,
                              timeout=300)
    out, data = tmp_path / "out", [f"--data_root={root}", "--dataset=text"]
    r = script("train.py", *data, *TINY, "--attn=dilated", "--window=4", "--dilation=0", f"--out_dir={out}")
    assert_clean_error(r, "GPTConfig.dilation=0 is invalid: must be an integer >= 1")
    r = script("train.py", *data, *TINY, "--attn=dilated", "--window=4", "--dilation=3", "--max_iters=4",
               "--eval_interval=4", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert load(out)["model_args"]["dilation"] == 3 and load(out)["iter_num"] == 4
    r = script("sample.py", f"--out_dir={out}", "--max_new_tokens=40", "--num_samples=1", "--dilation=2")
    assert r.returncode == 0 and "recomputes the prefix" in r.stderr and r.stdout.count("---------------") == 1, \
        r.stderr
    r = script("eval.py", f"--out_dir={out}", "--limit=2", "--attn=full,dilated", "--window=64", "--dilation=1",
               f"--json_out={tmp_path / 'eval.json'}")
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = {row["attn"]: row["value"] for row in json.loads((tmp_path / "eval.json").read_text())["results"]
           if row["metric"] == "ppl"}
    assert ppl["dilated"] == pytest.approx(ppl["full"], rel=1e-5)  # dilation 1, a window of block_size: full


def test_ctrl_c_says_where_the_run_resumes(root, tmp_path):
    """SIGINT mid-run: one line naming the checkpoint, its iteration and the command that resumes it, which does."""
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(REPO, "train.py"), f"--data_root={root}", "--dataset=text", *TINY,
           f"--out_dir={out}", "--eval_interval=2", "--max_iters=100000"]
    p = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # until its first checkpoint
            if (out / "ckpt.pt").exists():
                break
            assert p.poll() is None
            time.sleep(0.1)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=120)[1]
    finally:
        p.kill()
        p.wait()
    lines = [line for line in err.splitlines() if not line.startswith("overriding")]
    assert p.returncode == -signal.SIGINT and len(lines) == 1 and "Traceback" not in err, err
    it = load(out)["iter_num"]
    match = re.fullmatch(rf"interrupted \(last logged iteration \d+\): {re.escape(str(out / 'ckpt.pt'))} holds "
                         rf"iteration {it}; continue it with `python (train\.py .*--init_from=resume)`", lines[0])
    assert match and it >= 2, lines[0]
    resume = shlex.split(match.group(1))
    assert resume[1:-1] == cmd[2:]  # the same settings
    r = run(*resume, f"--max_iters={it + 1}")
    assert f"step {it}: train loss" in r.stdout and load(out)["iter_num"] == it + 1


@pytest.mark.parametrize("trained_on, args, message", [
    # the same padded vocab_size (256), other tokens: bytes, then two different sets of 200 characters
    (None, ["--dataset=chars"], "trained on bytes tokens of vocabulary 256, but"),
    ("chars", ["--dataset=chars2"], "trained on chars tokens of vocabulary 200, but"),
    (None, ["--n_layer=3"], "was trained with n_layer=2, but this run asks for n_layer=3"),
])
def test_resume_refuses_other_data_or_model(trained, train_args, root, tmp_path, trained_on, args, message):
    """One line, and the out_dir unchanged. trained_on: the dataset whose meta.json the checkpoint
    is given (a model trained on it would look the same)."""
    for name, content in files(trained).items():
        (tmp_path / name).write_bytes(content)
    if trained_on:
        ckpt = load(tmp_path)
        torch.save({**ckpt, "meta": P.load_meta(root / trained_on),
                    "config": {**ckpt["settings"], "data_dir": str(root / trained_on)}}, tmp_path / "ckpt.pt")
    before = files(tmp_path)
    r = run("train.py", *train_args, f"--out_dir={tmp_path}", "--init_from=resume", *args, check=False)
    assert_clean_error(r, message)
    assert files(tmp_path) == before


@pytest.mark.parametrize("change, message", [
    (dict(rng=None), "no 'rng' entry: it was edited, or is not what this repo writes"),
    (dict(settings=None, meta=None), "no 'settings' and no 'meta' entry"),
    (dict(iter_num=None, optimizer=None), "no 'optimizer' and no 'iter_num' entry"),
    (dict(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], momentum=0.9).state_dict()),
     "its 'optimizer' is not this model's AdamW state"),
    (dict(optimizer="sgd"), "'optimizer' is 'sgd', not an optimizer's state_dict"),
    (dict(iter_num=-1), "'iter_num' is -1, not an integer >= 0"),
    (dict(meta=[1, 2]), "'meta' fails: it is [1, 2], not a dict of entries"),
])
def test_resume_of_an_incomplete_checkpoint_is_one_line(trained, train_args, tmp_path, monkeypatch, change, message):
    """A checkpoint without an entry, or with another optimizer's state, stops a resume before anything is written."""
    for name, content in files(trained).items():
        (tmp_path / name).write_bytes(content)
    ckpt = {**load(tmp_path), **change}
    torch.save({k: v for k, v in ckpt.items() if v is not None}, tmp_path / "ckpt.pt")
    before = files(tmp_path)
    args = [*train_args, f"--out_dir={tmp_path}", "--init_from=resume", "--max_iters=8"]
    assert message in one_line_error(monkeypatch, "train.py", *args)
    assert files(tmp_path) == before


# -----------------------------------------------------------------------------
# sample.py

def test_sample_is_seeded(trained):
    args = ["sample.py", f"--out_dir={trained}", "--start=def ", "--num_samples=2", "--max_new_tokens=24"]
    a, b = (run(*args, "--seed=1").stdout for _ in range(2))
    samples = a.split("---------------\n")
    assert len(samples) == 3 and samples[-1] == "" and all(s.startswith("def ") for s in samples[:2])
    assert samples[0] != samples[1] and a == b  # fresh randomness per sample, the same per seed
    assert run(*args, "--temperature=0").stdout.startswith("def ")


def test_temperature_zero_is_greedy(trained):
    """temperature=0 takes the most likely token: the same tokens as sampling from the top 1."""
    model, _ = load_checkpoint(os.path.join(trained, "ckpt.pt"))
    x = torch.tensor([[100, 101, 102]])
    outs = []
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=1)):
        model.seed_sa(0)  # the same SA permutations for both
        outs.append(model.eval().generate(x, 12, **kwargs))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (1, 15)


def test_sample_errors(trained, tmp_path, monkeypatch):
    """One line each, before any model is loaded."""
    (tmp_path / "prompt.bin").write_bytes(bytes(range(128, 256)))
    cases = [(["--device=cuda"], "device='cuda': CUDA is not available here")] * (not torch.cuda.is_available())
    for args, message in cases + [(["--temperature=-1"], "temperature=-1.0: use a number > 0, or 0 for greedy"),
                          (["--top_k=-3"], "top_k=-3: use a value >= 1, or 0 to sample among all tokens"),
                          (["--max_new_tokens=-5"], "max_new_tokens=-5: use an integer >= 0"),
                          (["--num_samples=0"], "num_samples=0: use an integer >= 1"),
                          (["--seed=-1"], "seed=-1: use an integer >= 0"),
                          ([f"--start=FILE:{tmp_path / 'prompt.bin'}"], "not UTF-8 text"),
                          (["--start=FILE:nope.txt"], "--start=FILE:nope.txt: No such file or directory"),
                          (["--device=foo"], "device='foo': use cpu, cuda or cuda:N"),
                          (["--dtype=fp8"], "dtype='fp8': use one of float32, bfloat16, float16"),
                          (["--temperature=1e999"], "temperature=inf: use a finite number")]:
        assert message in one_line_error(monkeypatch, "sample.py", f"--out_dir={trained}", *args)
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}", check=False), "ckpt.pt not found")  # and as a process


def test_a_tokenizer_that_cannot_load_is_one_line_naming_the_checkpoint(trained, tmp_path, monkeypatch):
    """A checkpoint whose data's tokenizer is unknown, or a tiktoken encoding not available offline."""
    good = load(trained)
    torch.save({**good, "meta": {**good["meta"], "tokenizer": "nope"}}, tmp_path / "ckpt.pt")
    message = one_line_error(monkeypatch, "sample.py", f"--out_dir={tmp_path}")
    assert message.startswith(f"{tmp_path / 'ckpt.pt'}: unknown tokenizer 'nope': use bytes, chars or a tiktoken"), message

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    torch.save({**good, "meta": {**good["meta"], "tokenizer": "r50k_base", "vocab_size": 50257}}, tmp_path / "ckpt.pt")
    message = one_line_error(monkeypatch, "sample.py", f"--out_dir={tmp_path}")
    assert message.startswith(f"{tmp_path / 'ckpt.pt'}: tiktoken could not load the 'r50k_base' encoding"), message


# -----------------------------------------------------------------------------
# clear errors: data, checkpoints, configurator

def test_data_errors(root, tmp_path):
    meta = P.load_meta(root / "text")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "cut" / "train.bin").write_bytes((root / "text" / "train.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        P.load_tokens(tmp_path / "cut", "train", meta)
    with pytest.raises(ValueError, match="val.bin not found"):
        P.load_tokens(tmp_path / "cut", "val", meta)
    (tmp_path / "cut" / "val.bin").mkdir()
    with pytest.raises(ValueError, match="val.bin is a directory, not a file: re-run"):  # was "is missing"
        P.load_tokens(tmp_path / "cut", "val", meta)
    with pytest.raises(ValueError, match="holds token id [0-9]+ at token [0-9]+, but vocab_size is 10"):
        P.load_tokens(root / "text", "train", {**meta, "vocab_size": 10})
    with pytest.raises(ValueError, match="has no 'test' split"):
        P.load_tokens(root / "text", "test", meta)
    (tmp_path / "cut" / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt or not from this repo"):
        P.load_meta(tmp_path / "cut")
    os.remove(tmp_path / "cut" / "meta.json")
    with pytest.raises(ValueError, match="nanoGPT data"):
        P.load_meta(tmp_path / "cut")
    with pytest.raises(ValueError, match=re.escape(f"`python prepare_data.py --input_file=FILE --dataset=nope "
                                                   f"--data_root={tmp_path}`")):  # the root it is missing from
        P.load_meta(tmp_path / "nope")
    with pytest.raises(ValueError, match="first with `python prepare_data.py --dataset=shakespeare_char --data_root="):
        P.load_meta(tmp_path / "shakespeare_char")  # a name prepare_data.py knows


@pytest.mark.parametrize("dataset, change, message", [
    ("text", dict(dtype="float16"), "'dtype' is 'float16', which cannot hold token ids: use uint8 or uint16 or "
                                     "uint32 (vocab_size 256)"),
    ("text", dict(dtype="foo"), "'dtype' is 'foo', which cannot hold token ids"),
    ("text", dict(dtype="int16"), "'dtype' is 'int16', which cannot hold token ids"),
    ("mqar", dict(dtype="uint8", vocab_size=300, mqar=None), "'dtype' is 'uint8', which cannot hold token ids: use uint16"),
    ("text", dict(vocab_size="256"), "'vocab_size' is '256', not an integer from 1 to 2**32"),
    ("text", dict(vocab_size=300), "'vocab_size' is 300, not the 256 ids of bytes"),
    ("text", dict(tokens=[1, 2]), "'tokens' is [1, 2], not a map of each split to its token count"),
    ("text", dict(tokens={"train": -1, "val": 2}), "'tokens' is {'train': -1, 'val': 2}, not a map"),
    ("text", dict(eot=256), "'eot' is 256, not a token id below vocab_size 256"),
    ("text", dict(source=3), "'source' is 3, not a text"),
    ("text", dict(tokenizer="foo"), "has tokenizer='foo', which this repo cannot load"),  # train.py trained on it
    ("text", dict(tokenizer="gpt2"), "'vocab_size' is 256, not the 50257 ids of gpt2"),  # so did it on this
    ("chars", dict(chars=None), "'tokenizer' is 'chars', without chars, the 200 distinct characters of its tokens"),
    ("chars", dict(chars="abc"), "'chars' is 'abc', not the 200 distinct characters"),
    ("mqar", dict(mqar="x"), "'mqar' is 'x', not an MQAR layout"),
    ("mqar", dict(mqar={"seq_len": "64"}), "'mqar' is {'seq_len': '64'}, not an MQAR layout"),
    ("mqar", dict(mqar=dict(seq_len=64, num_pairs=100, num_queries=4, num_keys=31, min_gap=0)), "'mqar' is impossible: mqar needs 1 <= num_pairs (100)"),
    ("mqar", dict(tokens={"train": 100, "val": 64}), "'mqar' needs whole sequences of 64 tokens; tokens={'train': 100, 'val': 64}"),
])
def test_hand_edited_meta_is_one_line(root, tmp_path, dataset, change, message):
    """meta.json's every entry is checked for its type and range, by the one loader every script reads it through."""
    meta = {k: v for k, v in {**P.load_meta(root / dataset), **change}.items() if v is not None}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError) as e:
        P.load_meta(tmp_path)
    assert f"{tmp_path / 'meta.json'}" in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def test_float16_tokens_are_refused_by_train(root, tmp_path, monkeypatch):
    """The fault run's meta.json: dtype float16 over uint16 data trained to a loss of 0.0034. Now one line."""
    (tmp_path / "text").mkdir()
    for f in ("train.bin", "val.bin"):
        (tmp_path / "text" / f).write_bytes((root / "text" / f).read_bytes())
    (tmp_path / "text" / "meta.json").write_text(json.dumps({**P.load_meta(root / "text"), "dtype": "float16"}))
    message = one_line_error(monkeypatch, "train.py", f"--data_root={tmp_path}", "--dataset=text", *TINY,
                             f"--out_dir={tmp_path / 'out'}")
    assert "meta.json: 'dtype' is 'float16', which cannot hold token ids" in message
    assert not (tmp_path / "out").exists()


def test_token_ids_are_checked_over_the_whole_file(root, tmp_path, monkeypatch):
    """An id >= vocab_size past the first 2^20 tokens: one line when the file is opened, not an IndexError later."""
    n = (1 << 20) + 100
    ids = np.zeros(n, np.uint16)
    ids[n - 3] = 300
    (tmp_path / "big").mkdir()
    for split in ("train", "val"):
        ids.tofile(tmp_path / "big" / f"{split}.bin")
    meta = {**P.load_meta(root / "text"), "tokens": {"train": n, "val": n}}
    (tmp_path / "big" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"train.bin holds token id 300 at token {n - 3}, but vocab_size is 256"):
        P.load_tokens(tmp_path / "big", "train", meta)
    message = one_line_error(monkeypatch, "train.py", f"--data_root={tmp_path}", "--dataset=big", *TINY,
                             f"--out_dir={tmp_path / 'out'}")
    assert "train.bin holds token id 300" in message and not (tmp_path / "out").exists()


def test_load_checkpoint_errors(trained, tmp_path):
    good = load(trained)
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="not found"):
        load_checkpoint(path)
    os.mkdir(path)
    with pytest.raises(ValueError, match="ckpt.pt is a directory, not a file"):  # was "not found"
        load_checkpoint(path)
    os.rmdir(path)
    raw = open(os.path.join(trained, "ckpt.pt"), "rb").read()
    cases = [(raw[:len(raw) // 2], "unreadable"), (b"garbage", "unreadable"),
             ({"model": {}, "model_args": {"n_layer": 2, "n_embd": 32}}, "'model_args' is .*, not GPTConfig's fields"),
             ({**good, "model_args": {**good["model_args"], "n_embd": 33}}, "incompatible config"),
             ({**good, "model": {k: v for k, v in good["model"].items() if "mlp" not in k}}, "weights do not fit"),
             ({k: v for k, v in good.items() if k != "model"}, "no 'model' entry: it was edited"),
             ({**good, "model": {k: v * float("nan") for k, v in good["model"].items()}}, "weights hold NaN or inf"),
             ([1, 2], "it is \\[1, 2\\], not a dict of entries")]
    for content, message in cases:
        if isinstance(content, bytes):
            open(path, "wb").write(content)
        else:
            torch.save(content, path)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path)
    torch.save({k: v for k, v in good.items() if k != "meta"}, path)
    with pytest.raises(ValueError, match="no 'meta' entry: it was edited, or is not what this repo writes"):
        load_checkpoint(path, require=("meta",))
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}", check=False), "no 'meta' entry")  # its tokenizer
    model, ckpt = load_checkpoint(os.path.join(trained, "ckpt.pt"))
    assert all(torch.equal(v, good["model"][k]) for k, v in model.state_dict().items())
    torch.save({**good, "meta": {"tokenizer": "bytes", "vocab_size": 256}}, path)  # what sampling needs of meta.json
    assert load_checkpoint(path)[1]["meta"] == {"tokenizer": "bytes", "vocab_size": 256}
    for entry in ("optimizer", "scaler", "iter_num", "best_val_loss", "settings", "meta", "rng"):  # what restore reads
        torch.save({k: v for k, v in good.items() if k != entry}, path)
        with pytest.raises(ValueError, match=f"no '{entry}' entry: it was edited"):
            load_checkpoint(path, resume=(good["settings"], good["meta"]))


@pytest.mark.parametrize("old, new", [("shared", "layer"), ("head", "head")])
def test_a_checkpoint_from_before_sa_draw_loads(trained, tmp_path, old, new):
    """sa_draw was named sa_perm, and its "layer" was "shared": such a checkpoint loads, and resumes with sa_draw."""
    good = load(trained)
    torch.save({**good, **{k: {**{n: v for n, v in good[k].items() if n != "sa_draw"}, "sa_perm": old}
                           for k in ("model_args", "settings")}}, tmp_path / "ckpt.pt")
    settings = {**good["settings"], "sa_draw": new}
    model, ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"), resume=(settings, good["meta"]))
    assert model.config.sa_draw == new and ckpt["settings"] == settings


def rng_with(**states):
    """Change the checkpoint's rank-0 RNG states."""
    return lambda good: {"rng": [{**good["rng"][0], **states}]}


@pytest.mark.parametrize("change, message", [
    (lambda good: {"iter_num": -1}, "'iter_num' is -1, not an integer >= 0"),
    (lambda good: {"iter_num": "6"}, "'iter_num' is '6', not an integer >= 0"),
    (lambda good: {"iter_num": True}, "'iter_num' is True, not an integer >= 0"),
    (lambda good: {"best_val_loss": "1.5"}, "'best_val_loss' is '1.5', not a loss"),
    (lambda good: {"best_val_loss": float("nan")}, "'best_val_loss' is nan, not a loss"),
    (lambda good: {"settings": "x"}, "'settings' is 'x', not a dict"),
    (lambda good: {"meta": [1]}, "'meta' fails: it is [1], not a dict of entries"),
    (lambda good: {"meta": {**good["meta"], "dtype": "float16"}}, "'meta' fails: 'dtype' is 'float16'"),
    (lambda good: {"meta": {"tokenizer": "bytes"}}, "'meta' fails: no 'vocab_size' entry"),
    (lambda good: {"optimizer": "sgd"}, "'optimizer' is 'sgd', not an optimizer's state_dict"),
    (lambda good: {"scaler": {"scale": "x"}}, "'scaler' is {'scale': 'x'}, not a GradScaler's state_dict"),
    (lambda good: {"model": [1]}, "'model' is [1], not a state_dict"),
    (lambda good: {"model_args": [1]}, "'model_args' is [1], not GPTConfig's fields"),
    (lambda good: {"model_args": {**good["model_args"], "vocab_size": 2**40}},  # was a 2**40-row allocation
     "its weights do not fit its model_args (2 mismatched entries"),
    (lambda good: {"model_args": {**good["model_args"], "block_size": 10**12}},  # RoPE's tables: no weights, 10**12 rows
     "its model_args make a model of "),
    # edited in model_args only: trained the edited model, under a banner of the settings' values
    (lambda good: {"model_args": {**good["model_args"], "window": 16}}, "its model_args have window=16, its settings "
     "window=8: the file was edited"),
    (lambda good: {"model_args": {**good["model_args"], "sa_rule": "value"}}, "its model_args have sa_rule='value', "
     "its settings sa_rule='rank'"),
    (lambda good: {"rng": []}, "'rng' is [], not a list of each rank's RNG states"),
    (lambda good: {"rng": [1]}, "'rng' fails for rank 0: it is 1, not a dict of entries"),
    (rng_with(torch=torch.zeros(3, dtype=torch.uint8)), "'rng' fails for rank 0: 'torch' is a uint8 tensor of shape (3,), "
                                                          "not a uint8 tensor of shape (5056,)"),
    (rng_with(sampler=torch.zeros(5056)), "'rng' fails for rank 0: 'sampler' is a float32 tensor"),
    (rng_with(sa=None), "'rng' fails for rank 0: 'sa' is None"),
    (rng_with(numpy=("MT19937", [1, 2], 0, 0, 0.0)), "'rng' fails for rank 0: 'numpy' is ('MT19937', [1, 2], 0, 0, 0.0), not"),
    (rng_with(python="x"), "'rng' fails for rank 0: 'python' is 'x'"),
])
def test_every_checkpoint_entry_is_checked(trained, tmp_path, change, message):
    """Hand-edited entries: one line naming the entry, from load_checkpoint, which every script loads through."""
    good = load(trained)
    torch.save({**good, **change(good)}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert str(e.value).startswith(f"{tmp_path / 'ckpt.pt'}: {message}") and "\n" not in str(e.value), str(e.value)


def test_save_checkpoint_is_atomic(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint({"w": torch.ones(3)}, path)
    with pytest.raises(Exception):
        save_checkpoint({"w": lambda: 0}, path)  # fails while writing
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))


def configure(monkeypatch, *argv):
    """Run configurator.py as a script would, on a few globals."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    g = dict(n=1, lr=0.1, flag=False, name="a", opt=None, iters=None, CONSTANT="x",
             __annotations__={"iters": int | None, "opt": str | None})
    exec(open(os.path.join(REPO, "configurator.py")).read(), g)
    return g


def test_configurator(monkeypatch, tmp_path):
    path = tmp_path / "c.py"
    path.write_text("import math\nN = 5\nn = N\nname = 'b'\n_scratch = math.pi\n")  # N: the file's own helper
    g = configure(monkeypatch, str(path), "--n=7", "--lr=1", "--flag=True", "--name=hello world", "--opt=abc",
                  "--iters=9")
    assert {k: g[k] for k in g["setting_names"]} == dict(n=7, lr=1.0, flag=True, name="hello world", opt="abc", iters=9)
    assert configure(monkeypatch, "--iters=9", "--iters=None")["iters"] is None
    assert type(g["lr"]) is float and configure(monkeypatch, str(path))["n"] == 5
    for argv, message in [(["--m=1"], "unknown setting 'm'"), (["--CONSTANT=y"], "unknown setting"),
                          (["--n=abc"], "n must be of type int"), (["--n=1.5"], "n must be of type int"),
                          (["--flag=1"], "flag must be of type bool"), (["--lr=True"], "lr must be of type float"),
                          (["--iters=abc"], "iters must be of type int or None"),
                          (["--iters=1.5"], "iters must be of type int"),
                          (["--lr=-1e999"], "lr=-inf: use a finite number"),
                          (["--opt=(1, 2)"], "opt must be of type str or None"),
                          (["nope.py"], "nope.py: FileNotFoundError"), (["n=1"], "unexpected argument")]:
        with pytest.raises(ValueError, match=message):
            configure(monkeypatch, *argv)


def test_prepare_errors_are_one_line(tmp_path):
    """One line each, and nothing written."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("a")
    (tmp_path / "image.bin").write_bytes(bytes(range(256)) * 4)
    short, readme = f"--input_file={tmp_path / 'short.txt'}", f"--input_file={REPO}/README.md"
    for args, message in [(["--mqar_seq_len=ten"], "mqar_seq_len must be of type int"),
                          (["--dataset=nope"], "unknown dataset 'nope'"),
                          ([f"--input_file={tmp_path / 'empty.txt'}"], "empty.txt is empty"),
                          ([f"--input_file={tmp_path}"], "is a directory, not a file"),  # was "no such file"
                          ([short], "short.txt is too short to split into train and val"),
                          ([short, "--val_fraction=0"], "val_fraction=0.0: it must lie"),
                          ([readme, "--tokenizer=bogus"], "unknown tokenizer 'bogus': use bytes, chars"),
                          ([f"--input_file={tmp_path / 'image.bin'}", "--tokenizer=chars"],
                           "image.bin is not UTF-8 text (byte 128: b'\\x80\\x81\\x82\\x83'): use --tokenizer=bytes"),
                          (["--dataset=mqar", "--mqar_train_seqs=0"], "mqar_train_seqs=0: use an integer >= 1"),
                          (["--dataset=mqar", "--mqar_offset=100"], "mqar needs 0 <= mqar_offset (100) <="),
                          (["--dataset=../x"], "dataset='../x': use a plain name, no path"),
                          ([readme, "--dataset=../x"], "dataset='../x': use a plain name, no path"),
                          (["--hf_max_docs=-1"], "hf_max_docs=-1: use 0 (all), or on fineweb-edu more")]:
        r = run("prepare_data.py", f"--data_root={tmp_path / 'data'}", *args, check=False)
        assert_clean_error(r, message)
        assert "online" not in r.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, message", [
    (["--mqar_seed=-1"], "mqar_seed=-1: use an integer >= 0"),
    (["--dataset=mqar", "--mqar_seed=-1"], "mqar_seed=-1: use an integer >= 0"),
    (["--dataset=mqar", "--mqar_train_seqs=1000000000000"], "mqar_train_seqs=1000000000000: making 1,000,000,000,000 sequences"),
    (["--dataset=mqar", "--mqar_vocab=10000000000"], "(vocab 10,000,000,000) takes about"),
    (["--mqar_seq_len=0"], "mqar_seq_len=0: use an integer >= 1"),
    (["--mqar_offset=-1"], "mqar_offset=-1: use an integer >= 0"),
    (["--hf_val_docs=0"], "hf_val_docs=0: use an integer >= 1"),
    (["--dataset=fineweb-edu", "--hf_max_docs=3"], "hf_max_docs=3: use 0 (all), or on fineweb-edu more than "
     "hf_val_docs"),  # was a StopIteration traceback after the download began
    (["--dataset=wikitext-103", "--hf_max_docs=10"], "hf_max_docs=10: use 0 (all), or on fineweb-edu"),  # was ignored
    (["--val_fraction=1.5"], "val_fraction=1.5: it must lie between 0 and 1"),
    (["--adopt=True", "--tokenizer=chars"], "tokenizer='chars': --adopt needs a tokenizer with a fixed vocabulary"),
    (["--tokenizer=gpt2"], "tokenizer='gpt2': it applies to --input_file and --adopt only"),  # was ignored
])
def test_prepare_settings_are_checked_before_anything_is_written(tmp_path, args, message):
    """Every setting's range, named in one line, before any allocation: a setting far above what memory or disk
    holds too; --adopt over nanoGPT's files with the chars tokenizer (its vocabulary comes from text) too."""
    (tmp_path / "data" / "pystdlib").mkdir(parents=True)
    for split in ("train", "val"):  # nanoGPT's files, for --adopt
        np.zeros(10, np.uint16).tofile(tmp_path / "data" / "pystdlib" / f"{split}.bin")
    before = sorted(p.name for p in (tmp_path / "data").rglob("*"))
    r = run("prepare_data.py", f"--data_root={tmp_path / 'data'}", *args, check=False)
    lines = [line for line in r.stderr.splitlines() if not line.startswith("overriding")]
    assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "data").rglob("*")) == before


def test_mqar_larger_than_the_disk_is_refused(tmp_path, monkeypatch):
    """What MQAR's files need on disk is checked against what the disk has free, before anything is made."""
    monkeypatch.setattr(P.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(ValueError, match=r"mqar_train_seqs=100000, mqar_val_seqs=1000: their 6,464,000 tokens take "
                                         r"12 MiB on disk, but .* has 1 MiB free"):
        P.prepare_mqar(str(tmp_path / "mqar"), seq_len=64, num_pairs=4, num_queries=4, vocab=32, train_seqs=100000,
                       val_seqs=1000, seed=0)
    assert not (tmp_path / "mqar").exists()


def test_a_full_disk_leaves_no_partial_file(root, tmp_path, monkeypatch):
    """A write that fails (ENOSPC) midway removes the partial <split>.bin.tmp; the old dataset stays whole."""
    for name in ("mqar", "text"):
        (tmp_path / name).mkdir()
        for f in (root / name).iterdir():
            (tmp_path / name / f.name).write_bytes(f.read_bytes())
    before = {name: files(tmp_path / name) for name in ("mqar", "text")}
    write_batch, mqar_batch, calls = P.write_batch, P.mqar_batch, []

    def full_disk(real):  # the first call writes, the second finds the disk full
        def call(*args):
            calls.append(1)
            if len(calls) % 2 == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args)
        return call
    monkeypatch.setattr(P, "write_batch", full_disk(write_batch))
    with pytest.raises(OSError, match="No space left"):
        P.write_dataset(str(tmp_path / "text"), {"train": ["some text"], "val": ["more"]}, P.text_tokenizer("bytes"),
                        source="x")
    monkeypatch.setattr(P, "mqar_batch", full_disk(mqar_batch))
    with pytest.raises(OSError, match="No space left"):
        P.prepare_mqar(str(tmp_path / "mqar"), seq_len=64, num_pairs=8, num_queries=4, vocab=64, train_seqs=16,
                       val_seqs=16, seed=0)
    assert {name: files(tmp_path / name) for name in ("mqar", "text")} == before


def test_a_dataset_is_never_replaced_by_an_empty_one(root, tmp_path):
    """Rebuilding over a dataset: a bad or empty new one leaves the old one whole."""
    for name in ("mqar", "text"):
        (tmp_path / name).mkdir()
        for f in (root / name).iterdir():
            (tmp_path / name / f.name).write_bytes(f.read_bytes())
    before = {name: files(tmp_path / name) for name in ("mqar", "text")}
    for args, message in ((["--dataset=mqar", "--mqar_val_seqs=0"], "mqar_val_seqs=0: use an integer >= 1"),
                          (["--dataset=mqar", "--mqar_num_pairs=20"], "mqar needs 1 <= num_pairs (20)")):
        assert_clean_error(run("prepare_data.py", f"--data_root={tmp_path}", *args, check=False), message)
    with pytest.raises(ValueError, match="the val split of .* would be empty: nothing written"):
        P.write_dataset(str(tmp_path / "text"), {"train": ["some text"], "val": []}, P.text_tokenizer("bytes"),
                        source="x")
    assert {name: files(tmp_path / name) for name in ("mqar", "text")} == before


def test_copy_task_scores_both_halves(root, tmp_path):
    """--copy_task: each sequence is a passage twice; the val loss splits exactly into the first half's
    targets (T/2 - 1 of them) and the copied half's (T/2), and an odd block_size is refused."""
    run("train.py", f"--data_root={root}", "--dataset=text", *TINY, "--attn=full", "--copy_task=True",
        "--max_iters=2", "--eval_interval=2", f"--out_dir={tmp_path}")
    ev = [r for r in read_log(tmp_path) if "val_loss" in r][-1]
    h, T = 32, 64
    assert ev["val_loss"] == pytest.approx(((h - 1) * ev["val_first"] + h * ev["val_second"]) / (T - 1), rel=1e-5)
    assert ev["val_first"] != pytest.approx(ev["val_second"], abs=1e-4)
    r = run("train.py", f"--data_root={root}", "--dataset=text", *TINY, "--copy_task=True", "--block_size=63",
            f"--out_dir={tmp_path / 'odd'}", check=False)
    assert_clean_error(r, "copy_task=True: it needs an even block_size")


def test_settings_that_used_to_be_ignored_or_misread(root, tmp_path, monkeypatch, train_args, trained):
    """A config file's list was skipped silently; lr_decay_iters=0 meant max_iters (0 is falsy); a resume with
    max_iters below the checkpoint's iteration trained nothing and said done; '²' passed as an MQAR id."""
    config = tmp_path / "betas.py"
    config.write_text("betas = [0.9, 0.95]\n")
    assert one_line_error(monkeypatch, "train.py", str(config)) == f"{config}: unknown setting 'betas'; --help lists them"
    config.write_text("window = 64\nbatch_size = 8 // 0\n")   # a config file is code: its own error, in one line
    assert one_line_error(monkeypatch, "train.py", str(config)) == \
        f"{config}:2: ZeroDivisionError: integer division or modulo by zero"
    config.write_bytes("attn = 'sa'  # caf\xe9\n".encode("latin-1"))
    assert one_line_error(monkeypatch, "train.py", str(config)).startswith(f"{config}: UnicodeDecodeError: 'utf-8'")
    out = tmp_path / "decay"
    run("train.py", *train_args, "--max_iters=3", "--warmup_iters=0", "--lr_decay_iters=0", "--min_lr=1e-5",
        f"--out_dir={out}")
    assert {r["lr"] for r in map(json.loads, open(out / "log.jsonl")) if "lr" in r} == {1e-5}
    line = one_line_error(monkeypatch, "train.py", *train_args, "--max_iters=2", f"--out_dir={trained}",
                          "--init_from=resume")
    assert line == f"max_iters=2: {trained / 'ckpt.pt'} is at iteration 6 already: raise max_iters to train on"
    encode = P.get_tokenizer({"tokenizer": "ids", "vocab_size": 32})[0]
    with pytest.raises(ValueError, match="this dataset's tokens are numbers"):
        encode("3 ²")


def test_adopt_checks_every_id_before_it_writes_meta(tmp_path):
    """--adopt wrote a meta.json of vocab 256 over ids up to 65535 (nanoGPT's GPT-2 data adopted as bytes): every
    later load refused it. Now the ids are checked first, and nothing is written."""
    data = tmp_path / "ng"
    data.mkdir()
    for split in ("train", "val"):
        np.arange(300, dtype=np.uint16).tofile(data / f"{split}.bin")
    with pytest.raises(ValueError, match=r"train.bin holds token id 256 at token 256, but vocab_size is 256"):
        P.adopt_nanogpt(str(data), "bytes")
    assert not (data / "meta.json").exists()
    for split in ("train", "val"):
        (np.arange(300, dtype=np.uint16) % 256).tofile(data / f"{split}.bin")
    P.adopt_nanogpt(str(data), "bytes")
    assert P.load_meta(str(data))["tokens"] == {"train": 300, "val": 300}


def test_api_loaders_take_only_what_they_can_use(trained, tmp_path):
    """get_tokenizer on an incomplete meta (a KeyError), load_task_file with a negative limit (it dropped the last
    document), load_checkpoint onto a device that is none: one line each."""
    for meta, problem in (({"tokenizer": "chars", "vocab_size": 3}, "'tokenizer' is 'chars', without chars"),
                          ({"tokenizer": "bytes"}, "no 'vocab_size' entry"),
                          ({}, "no 'vocab_size' and no 'tokenizer'"), ([1], "it is \\[1\\], not a dict")):
        with pytest.raises(ValueError, match=f"the tokenizer: its meta: {problem}"):
            P.get_tokenizer(meta)
    task = tmp_path / "t.jsonl"
    task.write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n')
    with pytest.raises(ValueError, match="limit=-1: use an integer >= 0"):
        tasks.load_task_file(str(task), -1)
    with pytest.raises(ValueError, match="device='gpu': use cpu, cuda or cuda:N"):
        load_checkpoint(str(trained / "ckpt.pt"), "gpu")


# -----------------------------------------------------------------------------
# Fine-tuning GPT-2's weights (offline: a tiny random GPT2LMHeadModel saved to a directory), and issue 44's cases

@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A directory holding a tiny random GPT2LMHeadModel of 256 token ids (the bytes of `text`), 64 positions."""
    import transformers
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("attn", ["full", "sa+swa"])
def test_finetunes_a_saved_gpt2_with_any_attention(root, tmp_path, tiny_gpt2, attn):
    """--init_from=<a GPT-2's directory>: its weights, the attention switched to --attn (the paper's swap), cropped to
    block_size, trained and resumed; a second fine-tune into its out_dir is refused. With full attention its first
    eval is the GPT-2's own loss on that batch."""
    import transformers
    args = [f"--data_root={root}", "--dataset=text", *TINY, f"--attn={attn}", "--eval_interval=2", "--lr_decay_iters=4",
            f"--out_dir={tmp_path}", "--block_size=32"]
    run("train.py", *args, f"--init_from={tiny_gpt2}", "--max_iters=2")
    ckpt = load(tmp_path)
    assert ckpt["model_args"]["pos_emb"] == "learned" and ckpt["model_args"]["bias"] and \
        ckpt["model_args"]["block_size"] == 32 and ckpt["model_args"]["attn"] == attn
    assert any(k.endswith("attn.gate.weight") for k in ckpt["model"]) == (attn == "sa+swa")
    first = next(json.loads(line) for line in open(tmp_path / "log.jsonl") if "val_loss" in line)
    if attn == "full":  # the same batches as estimate_loss draws: ours equals the GPT-2's own loss
        hf = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2).eval()
        meta = P.load_meta(root / "text")
        data, losses = P.load_tokens(str(root / "text"), "val", meta), []
        gen = torch.Generator().manual_seed(1337)
        for _ in range(2):  # TINY's eval_iters
            ix = torch.randint(len(data) - 32, (4,), generator=gen).numpy()  # train.py's get_batch: text
            x = torch.from_numpy(np.stack([data[i:i + 32] for i in ix]).astype(np.int64))
            y = torch.from_numpy(np.stack([data[i + 1:i + 33] for i in ix]).astype(np.int64))
            with torch.no_grad():
                losses.append(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item())
        assert first["val_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert "step 2: train loss" in run("train.py", *args, "--init_from=resume", "--max_iters=4").stdout
    before = files(tmp_path)  # a second fine-tune into this out_dir: refused, as a run from scratch is
    assert_clean_error(run("train.py", *args, f"--init_from={tiny_gpt2}", "--max_iters=2", check=False),
                       "ckpt.pt exists: continue it with --init_from=resume")
    assert files(tmp_path) == before


def test_gpt2_fine_tuning_errors_are_one_line(root, tmp_path, tiny_gpt2, monkeypatch):
    """A hub name with no network, a block_size past GPT-2's positions, a directory without a model: one line each."""
    base = [f"--data_root={root}", "--dataset=text", *TINY, f"--out_dir={tmp_path / 'out'}"]
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: offline, at once
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))      # an empty cache
    assert "--init_from=gpt2: cannot load it" in one_line_error(monkeypatch, "train.py", *base, "--init_from=gpt2")
    assert "block_size=128: the model holds at most 64 positions" in one_line_error(
        monkeypatch, "train.py", *base, f"--init_from={tiny_gpt2}", "--block_size=128")
    assert f"--init_from={tmp_path}: cannot load it" in one_line_error(monkeypatch, "train.py", *base,
                                                                       f"--init_from={tmp_path}")
    assert not (tmp_path / "out").exists()


def test_samples_a_saved_gpt2_with_any_attention_swapped_in(tiny_gpt2, tmp_path, monkeypatch, capsys):
    """sample.py --init_from=<a GPT-2's directory> --attn=... --window=...: the paper's training-free swap as one
    command, its text through GPT-2's BPE (tiktoken's gpt2; here a tiny stand-in), its tokens those of from_gpt2 and
    swap_attention. sa+swa, whose gates need training, is refused in one line."""
    import transformers
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2)
    with torch.no_grad():  # at init every kind gives near-uniform logits: weights that make attention matter
        for p in gpt2.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    gpt2.save_pretrained(tmp_path)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiny_encoding(50256))
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # configurator.py sets the script's own
    enc, samples = tiny_encoding(50256), set()
    for attn in ("full", "swa", "sa", "moba"):
        args = [f"--init_from={tmp_path}", f"--attn={attn}", "--window=4", "--start=ab", "--num_samples=1",
                "--max_new_tokens=20", "--temperature=1.0", "--seed=3", "--device=cpu", "--dtype=float32"]
        monkeypatch.setattr(sys, "argv", ["sample.py", *args])
        runpy.run_path(os.path.join(REPO, "sample.py"), run_name="__main__")
        got = capsys.readouterr().out
        model = from_gpt2(str(tmp_path)).swap_attention(attn=attn, window=4).eval()
        torch.manual_seed(3)
        model.seed_sa(3)
        want = model.generate(torch.tensor([enc.encode("ab")]), 20, temperature=1.0, top_k=200)
        assert got == enc.decode(want[0].tolist()) + "\n---------------\n"
        samples.add(got)
    assert len(samples) == 3  # the swap happened: moba's one chunk of 64 keys here is full attention, the others differ
    message = one_line_error(monkeypatch, "sample.py", f"--init_from={tmp_path}", "--attn=sa+swa")
    assert "cannot swap attn='full' -> 'sa+swa' without training" in message


def test_a_flipped_byte_in_a_checkpoint_is_refused(trained, tmp_path, train_args, monkeypatch):
    """torch.load skips the zip's checksums: a checkpoint with one byte flipped in its weights loaded, in sample.py,
    eval.py and a resume. load_checkpoint, which all of them read through, now names the damaged entry."""
    raw = bytearray((trained / "ckpt.pt").read_bytes())
    with zipfile.ZipFile(trained / "ckpt.pt") as z:
        info = max(z.infolist(), key=lambda i: i.file_size)  # the largest tensor's storage
    raw[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2] ^= 0x10
    (tmp_path / "ckpt.pt").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"is damaged: its entry {re.escape(info.filename)} fails its checksum"):
        load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert "is damaged" in one_line_error(monkeypatch, "sample.py", f"--out_dir={tmp_path}")
    assert "is damaged" in one_line_error(monkeypatch, "train.py", *train_args, f"--out_dir={tmp_path}",
                                          "--init_from=resume", "--max_iters=8")


@pytest.mark.parametrize("args, message", [
    (["--min_lr=1e39"], "min_lr=1e+39: use a value from 0 to learning_rate"),  # was a RuntimeError inside AdamW
    (["--min_lr=0.1", "--learning_rate=0.01"], "min_lr=0.1: use a value from 0 to learning_rate"),  # a rising "decay"
])
def test_min_lr_is_checked_as_learning_rate_is(root, tmp_path, monkeypatch, args, message):
    assert message in one_line_error(monkeypatch, "train.py", f"--data_root={root}", "--dataset=text", *TINY,
                                     f"--out_dir={tmp_path / 'out'}", *args)


def test_cpu_0_is_a_device(root, tmp_path, monkeypatch):
    """--device=cpu:0 was refused by train.py, sample.py, eval.py and load_checkpoint; it is the CPU."""
    args = [f"--data_root={root}", "--dataset=text", *TINY, "--max_iters=2", "--eval_interval=2"]
    run("train.py", *[a for a in args if a != "--device=cpu"], "--device=cpu:0", f"--out_dir={tmp_path}")
    run("sample.py", f"--out_dir={tmp_path}", "--device=cpu:0", "--max_new_tokens=4", "--num_samples=1")
    assert load_checkpoint(str(tmp_path / "ckpt.pt"), device="cpu:0")[0].lm_head.weight.device.type == "cpu"
    ev.run({"out_dir": str(tmp_path), "data_root": str(root), "device": "cpu:0", "limit": 2, "plot": ""})


def test_upper_case_names_in_a_config_file_are_its_helpers(root, tmp_path):
    """nanoGPT's configurator lets a config file compute settings from its own names (`N = 2`, then `n_layer = N`):
    they are no settings, and used to be refused as unknown ones."""
    config = tmp_path / "helpers.py"
    config.write_text("N = 2\nWIDTH = 16\nn_layer = N\nn_embd = 2 * WIDTH\n")
    r = run("train.py", str(config), f"--data_root={root}", "--dataset=text", *TINY, "--max_iters=1",
            "--eval_interval=1", f"--out_dir={tmp_path / 'out'}")
    assert f"{config}: n_layer = 2" in r.stderr and f"{config}: n_embd = 32" in r.stderr
