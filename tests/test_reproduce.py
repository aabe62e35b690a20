"""The miniature reproduction's steps (results/recall.py, decisive.py, lm.py, far_copy.py, copy_rule.py,
copy_paths.py, common.py) and its pipeline, end to end in its --fast mode (about 5 minutes), so that
results/reproduce.py cannot rot. Run: python -m pytest -q tests/test_reproduce.py"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import common
import copy_paths
import copy_rule
import decisive
import far_copy
import lm
import recall
from prepare_data import mqar_batch
from provenance import provenance, result_rows, stamp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("sa_draw,n_head,depth,window", [("layer", 1, 2, 4), ("layer", 4, 3, 4), ("head", 4, 2, 4),
                                                         ("head", 4, 3, 8)])
def test_retrievable_matches_its_closed_form(sa_draw, n_head, depth, window):
    """attention.py's masks over recall sequences give the fraction of answers whose value token a query
    sees at layer >= 2 that the closed form predicts; the issue's approximation is a little above it."""
    meta = {"vocab_size": 32, "mqar": dict(seq_len=64, num_pairs=4, num_queries=4, num_keys=15, offset=1)}
    x, y = mqar_batch(np.random.default_rng(0), 200, meta)                    # (200, 64) each
    heads = n_head if sa_draw == "head" else 1  # sa_draw=layer: the heads share one permutation
    exact, approx = recall.retrievable_formula(64, window, depth, heads)
    for kind in ("sa", "sa+swa"):  # every answer is > window back: SWA's path adds nothing
        r = recall.retrievable(kind, sa_draw, n_head, depth, x, y, window, draws=300)
        assert abs(r - exact) < 0.02, (kind, r, exact)
    assert exact < approx < exact + 0.03
    assert recall.retrievable("swa", sa_draw, n_head, depth, x, y, window) == 0
    assert recall.retrievable("full", sa_draw, n_head, depth, x, y, window) == 1
    assert recall.retrievable("sa+swa", sa_draw, n_head, 1, x, y, window) == 0  # layer 1 forms the binding


def test_arm_verdict_follows_the_preregistered_rule():
    v = lambda P, **accs: decisive.arm_verdict(decisive.ARMS[P], accs)
    base = dict(full=[0.99, 0.97, 1.0], swa=[0.06], moba=[0.5])
    assert v(4, **base, **{"sa+swa": [0.8, 0.76, 0.9]}) == "confirms"
    assert v(4, **base, **{"sa+swa": [0.3, 0.35, 0.2]}) == "refutes"
    assert v(4, **base, **{"sa+swa": [0.3, 0.8, 0.2]}) == "partial"
    assert v(4, **dict(base, full=[0.99, 0.94, 1.0]), **{"sa+swa": [0.8] * 3}).startswith("not decidable: full")
    assert v(4, **dict(base, swa=[0.11]), **{"sa+swa": [0.8] * 3}).startswith("not decidable: SWA")
    assert v(1, full=[1.0], swa=[0.05], **{"sa+swa": [0.95]}).startswith("not decidable (not run: sa+swa 1 of 2")
    assert v(4, **dict(base, moba=[]), **{"sa+swa": [0.8, 0.76, 0.9]}) == "confirms"  # MoBA is beside the rule
    assert v(4, **base, **{"sa+swa": [0.8, 0.9]}).startswith("not decidable (not run: sa+swa 2 of 3")
    assert v(4, **base, **{"sa+swa": [0.8, 0.5]}).startswith("partial (2 of 3")  # no third seed can change it
    assert v(4, **dict(base, swa=[]), **{"sa+swa": [0.5]}).startswith("not decidable (not run: swa 0 of 1")


def test_sources_in_window_is_the_rank_rule():
    """A copied-half query's source is in its SA window exactly where attention.sa_mask lets it see that key."""
    import torch

    import attention
    T, t = 64, torch.arange(31, 63)
    perms = torch.rand(5, T, generator=torch.Generator().manual_seed(0)).argsort(-1)   # (5, T)
    for window in (1, 4, 16, 40):
        want = torch.stack([attention.sa_mask(window, p)[t, t - 31] for p in perms])   # (5, T/2)
        assert torch.equal(copy_paths.sources_in_window(perms, window, T), want)
    identity = torch.arange(T)                                                # slots = positions: 31 apart
    inside = copy_paths.sources_in_window
    assert inside(identity, 32, T).all() and not inside(identity, 31, T).any()


def test_copy_verdicts_follow_the_preregistered_rule():
    v = lambda sa_swa, seeds=(0, 1, 2), full=0.05, swa=(2.0, 1.95), first=2.0: copy_rule.copy_verdict(
        {**{("full", s): (first, full) for s in seeds}, **{("swa", s): swa for s in seeds},
         **{("sa+swa", s): (first, l2) for s, l2 in zip(seeds, sa_swa)}}, list(seeds))
    assert v([0.5, 0.9, 1.0])[0] == "confirms"
    assert v([1.0, 1.0, 1.0])[1] == pytest.approx([0.5] * 3)  # (1.95 - 1) / (1.95 - 0.05)
    assert v([1.9, 1.94, 1.95])[0] == "refutes"
    assert v([0.5, 1.9, 1.0])[0] == "partial"
    assert v([0.5, 0.5, 0.5], first=2.03)[0] == "partial"  # copies, but its plain-LM half is 0.03 behind SWA's
    assert v([0.5] * 3, full=0.31)[0].startswith("not decidable (full")
    assert v([0.5] * 3, swa=(2.0, 1.79))[0].startswith("not decidable (full attention does not copy, or SWA does")
    assert v([0.5, 0.5])[0] == "not decidable (not run)"
    rows = {("full", 0): (2.0, 0.0), ("swa", 0): (2.0, 2.1), ("sa+swa", 0): (2.3, 1.3)}  # D: -2.0, +0.1, -1.0
    assert copy_rule.copy_r_prime(rows, [0]) == pytest.approx([(0.1 + 1.0) / (0.1 + 2.0)])
    assert copy_rule.copy_verdict(rows, [0])[1] == pytest.approx([(2.1 - 1.3) / 2.1])  # R does not subtract L1
    reading = copy_rule.copy_reading
    assert reading("partial", [0.7, 0.6], [0.8, 0.5]) == "copies, at a cost in local modelling"  # only L1 failed
    assert reading("partial", [0.7, 0.4], [0.8, 0.9]) is None  # R fails too: partial, no more
    assert reading("partial", [0.7, 0.6], [0.8, 0.4]) is None and reading("confirms", [0.7], [0.8]) is None
    layer = lambda gate, inside, outside: dict(gate_sa=gate, loss_inside=inside, loss_outside=outside)  # noqa: E731
    q = dict(first=1.26, second=0.94, layers=[layer(0.06, 0.95, 0.94), layer(0.31, 0.77, 1.06), layer(0.01, 0.9, 0.9)])
    assert copy_paths.used_split(q) == ([2], 0.77, 1.06, "mixed")  # w=64 seed 2 on its one used layer
    assert copy_paths.path_reading(1.26, 0.94, 0.95, 0.94) == "relays carry it too"  # layer 1 alone reads relays
    q["layers"][2]["gate_sa"] = 0.2  # two used layers: the union needs the model
    assert copy_paths.used_split(q) is None
    assert copy_paths.used_split(dict(q, loss_direct_used=0.5, loss_other_used=1.2)) == (
        [2, 3], 0.5, 1.2, "the shortcuts carry it directly")
    c = far_copy.SIZES  # the 12,000-iteration question, from 4,000-iteration rows and 12,000-iteration curves
    row = lambda k, s, w, first, second: dict(task="copy", attn=k, seed=s, window=w, first=first, second=second)  # noqa
    rows = [row("full", s, c["window"], 1.2, 0.01) for s in c["seeds"]] + [
        row(k, s, c["wide"], 1.2, 1.1 if k == "swa" else 0.4) for s in c["seeds"] for k in ("swa", "sa+swa")]
    curve = lambda copied: [(it, 1.2, 1.15) for it in (4000, 8000)] + [(c["long_iters"], 1.2, copied)]  # noqa: E731
    long = lambda k, s, copied=0.05, end=c["long_iters"]: dict(  # noqa: E731
        attn=k, seed=s, window=c["wide"], curve=[p for p in curve(1.15 if k == "swa" else copied) if p[0] <= end])
    assert copy_rule.long_verdict(rows, [], c)["verdict"] == "not decidable (not run)"
    one = copy_rule.long_verdict(rows, [long("swa", 0), long("sa+swa", 0), long("sa+swa", 1, end=8000)], c)
    assert one["answers"] == ["closes"]
    assert one["answer"] == one["verdict"] == "not decidable (seed 0 of 0, 1, 2 finished)"
    every = [long(k, s, copied=0.05 if s else 0.5) for s in c["seeds"] for k in ("swa", "sa+swa")]
    v = copy_rule.long_verdict(rows, every, c)  # seed 0: copied 0.5 > 0.2; seeds 1, 2: copied 0.05, first halves equal
    assert v["answers"] == ["does not close", "closes", "closes"] and v["answer"] == "narrows"
    assert v["advantage_4k_committed"] == pytest.approx([0.7] * 3) and v["R"] == pytest.approx([.65 / 1.14, 1.1 / 1.14,
                                                                                                1.1 / 1.14])
    assert v["verdict"] == "confirms" and 4000 in v["at"] and 8000 in v["at"]  # R >= 0.5, equal first halves
    two = copy_rule.long_verdict(rows, every[2:], c)  # seeds 1 and 2 only: their answers, no verdict over all
    assert two["answers"] == ["closes"] * 2 and two["answer"].startswith("not decidable (seed 1, 2 of 0, 1, 2")
    T = c["T"]
    swa = {T // 8: 2.0, T // 4: 1.5, T // 2: 0.1}
    assert copy_rule.swap_verdict({T // 8: 1.9, T // 4: 1.4, T // 2: 0.2}, swa, T) == "confirms"  # w = T/2: not counted
    assert copy_rule.swap_verdict({T // 8: 2.1, T // 4: 1.6, T // 2: 0.2}, swa, T) == "refutes"
    assert copy_rule.swap_verdict({T // 8: 1.9, T // 4: 1.6, T // 2: 0.2}, swa, T) == "partial"


@pytest.fixture
def byte_data(tmp_path):
    """Points the steps' work dir at a pystdlib-shaped dataset in tmp_path made from given train and val bytes."""
    def make(train, val):
        data = tmp_path / "data" / "pystdlib"
        data.mkdir(parents=True, exist_ok=True)
        (data / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16",
                                                    "tokens": {"train": len(train), "val": len(val)}}))
        for split, b in (("train", train), ("val", val)):
            np.frombuffer(b, np.uint8).astype(np.uint16).tofile(data / f"{split}.bin")
    work, common.work = common.work, str(tmp_path)
    yield make
    common.work = work


def test_copy_sequences_repeat_their_first_half(byte_data):
    """The training-free swap's val sequences: each target of the second half is the byte T/2 back."""
    import torch
    byte_data(b"", bytes(range(256)) * 20)
    x, y = far_copy.copy_val(3, 64)
    assert x.shape == y.shape == (3, 64) and torch.equal(x[:, :32], x[:, 32:])
    assert torch.equal(y[:, 31:63], x[:, :32])  # the second half's targets: the first half again
    assert len({tuple(r) for r in x.tolist()}) == 3  # three random passages


def test_unseen_in_train_marks_the_ngrams_the_train_split_lacks(byte_data):
    """A query is 'unseen' when its 8 bytes of context and its target never occur together in train."""
    byte_data(b"..abcdefghX..", b"")
    text = np.frombuffer(b"-abcdefghX-abcdefghY", np.uint8).astype(np.int64)
    x, y = text[None, :-1], text[None, 1:]                                   # (1, T) each
    unseen = far_copy.unseen_in_train(x, y)
    t = [i for i in range(x.shape[1]) if x[0, i] == ord("h")]               # the queries that predict X, then Y
    assert not unseen[0, t[0]] and unseen[0, t[1]]  # abcdefgh+X is in train, abcdefgh+Y is not
    assert not unseen[0, :7].any()                  # fewer than 8 bytes of context: never counted


def test_copy_distance_finds_the_nearest_earlier_copy():
    """A long-range token repeats an earlier occurrence (8 bytes of context, then the same target byte); its
    distance is how far before the query the byte to copy stands."""
    text = np.frombuffer(b"abcdefghX--abcdefghY---abcdefghX..", np.uint8).astype(np.int64)
    x, y = text[None, :-1], text[None, 1:]                                    # (1, T) each
    dist = lm.copy_distance(x, y)
    t = [i for i in range(x.shape[1]) if x[0, i] == ord("h")]                 # the queries that predict X, Y, X
    assert dist[0, t[0]] == dist[0, t[1]] == -1  # the first X, and Y (same context, another byte): no copy
    assert dist[0, t[2]] == t[2] - (t[0] + 1)    # the X after the first "abcdefgh", 22 tokens back
    assert (dist[0, :7] == -1).all()             # fewer than 8 bytes of context


def test_visible_keys_counts_what_the_masks_show():
    """Over all queries SA sees exactly as many keys as SWA at the same window, spread: late queries see
    more; the sink adds token 0 to SWA beyond the window; MoBA sees its own chunk plus 3 past ones."""
    T, w = 64, 8
    swa, sa, sink, moba = (lm.visible_keys(k, w, T) for k in ("swa", "sa", "sink", "moba"))
    assert abs(sa.mean() - swa.mean()) < 1e-4 and sa[-8:].mean() > 1.5 * w and sa[:8].mean() < w
    assert (sink[w:] == swa[w:] + 1).all() and (sink[:w] == swa[:w]).all()
    assert moba[-1] == w and moba[0] == 1  # chunks of w // 4 = 2, 4 chunks at most


def test_sink_swap_adds_token_zero_to_swa():
    """The sink baseline reaches the model: with it the losses differ from SWA's exactly where token 0 is
    out of the window, and with a window of T it is full attention."""
    import torch

    from model import GPT, GPTConfig
    torch.manual_seed(0)
    T, w = 32, 4
    model = GPT(GPTConfig(block_size=T, vocab_size=16, n_layer=1, n_head=2, n_embd=16, attn="full")).eval()
    x = torch.randint(16, (2, T))
    y = torch.randint(16, (2, T))
    swa, sink = (lm.swapped_nll(model, k, w, x, y) for k in ("swa", "sink"))    # (2, T) each
    assert np.allclose(swa[:, :w], sink[:, :w]) and not np.isclose(swa[:, w:], sink[:, w:]).any()
    assert np.allclose(lm.swapped_nll(model, "sink", T, x, y), lm.swapped_nll(model, "full", None, x, y),
                       atol=1e-5)


def test_reproduce_fast_writes_every_result(tmp_path):
    out, work = tmp_path / "results", tmp_path / "work"
    r = subprocess.run([sys.executable, "results/reproduce.py", "--fast=True", f"--out={out}", f"--work={work}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for png in ("sa_picture", "lm", "swap", "mqar", "mqar_decisive", "recall_swap", "coverage", "lm1024", "demo"):
        assert (out / f"{png}.png").stat().st_size > 1000, png
    kinds = {"full", "swa", "sa", "sa+swa", "moba"}
    mqar = json.loads((out / "mqar.json").read_text())
    assert {r["attn"] for r in mqar["runs"]} == kinds and all(0 <= r["val_acc"] <= 1 for r in mqar["runs"])
    assert {r["cell"] for r in mqar["runs"]} == kinds | {"sa+swa-head", "full-4heads"}
    assert [(a["cell"], sorted(a["accs"])) for a in mqar["permutation_average"]] == [
        (c, ["1", "16", "4"]) for c in ("sa", "sa+swa", "sa+swa-head")]  # logits averaged over 1, 4 and 16 draws
    predicted = mqar["predicted"]
    assert predicted["swa/2"]["reachable"] == predicted["swa/2"]["retrievable"] == 0
    assert predicted["full/2"]["reachable"] == predicted["full/2"]["retrievable"] == 1
    for measure in ("reachable", "retrievable"):  # 4 permutations: more shortcuts
        assert predicted["sa+swa-head/2"][measure] > predicted["sa+swa/2"][measure]
    assert predicted["sa+swa/2"]["retrievable"] < predicted["sa+swa/2"]["reachable"]  # a relay carries no binding
    decisive = json.loads((out / "mqar_decisive.json").read_text())
    assert {(r["P"], r["cell"]) for r in decisive["runs"]} == {(1, "full"), (1, "sa+swa"), (4, "sa+swa"), (4, "moba")}
    assert set(decisive["verdicts"]) == {"1", "4"} and decisive["overall"]
    search = json.loads((out / "mqar_search.json").read_text())
    assert len(search["runs"]) > 1 and all(0 <= r["val_acc"] <= 1 for r in search["runs"])
    recall = json.loads((out / "recall_swap.json").read_text())
    assert {r["attn"] for r in recall["runs"]} == {"swa", "sa", "moba"} and 0 <= recall["full"] <= 1
    lm = json.loads((out / "lm.json").read_text())
    assert {r["attn"] for r in lm["runs"]} == kinds - {"moba"}
    assert all(len(curve) >= 2 for curve in lm["curves"].values())
    swap = json.loads((out / "swap.json").read_text())
    assert {r["attn"] for r in swap["runs"]} == {"full", "swa", "sink", "sa", "moba"}
    assert all(len(r["loss_all"]) == (2 if r["attn"] == "sa" else 1) for r in swap["runs"])  # 2 SA draws in --fast
    lm1024 = json.loads((out / "lm1024.json").read_text())
    assert {(r["task"], r["attn"]) for r in lm1024["runs"]} == {("plain", "full"), ("plain", "swa")} | {
        ("copy", k) for k in ("full", "swa", "sa+swa", "moba")}
    assert all({"first", "second"} <= r.keys() for r in lm1024["runs"] if r["task"] == "copy")
    assert all(r["split"]["all"] > 0 for r in lm1024["runs"] if r["task"] == "plain")
    assert lm1024["copy_verdict"].startswith("not decidable") and lm1024["swap_verdict"]  # 6 iterations copy nothing
    assert {r["attn"] for r in lm1024["swap"]} == {"swa", "sink", "sa", "moba"} and lm1024["swap_full"] > 0
    assert set(lm1024["verdicts"]) == {"4", "8"} and lm1024["full_window_check"]["identical"]
    paths = lm1024["copy_paths"]
    assert set(paths) == {"copy-sa+swa-w4-s0", "copy-sa+swa-w8-s0", "copy-sa+swa-w8-s0-layer"}
    for q in paths.values():  # the measured share of direct queries is what the masks predict
        assert abs(q["direct"] - q["direct_predicted"]) < 0.15 and len(q["layers"]) == 4 and q["reading"]
    speed = json.loads((out / "speed_cpu.json").read_text())
    assert {r["kind"] for r in speed["rows"]} == {"full", "swa", "sa", "moba"}
    rules = json.loads((out / "sa_rules.json").read_text())["runs"]
    assert {(r["task"], r["attn"], r["sa_rule"]) for r in rules} == {
        (t, k, u) for t in ("lm", "recall") for k in ("sa", "sa+swa") for u in ("rank", "value")}
    assert all(0 <= r["val_acc"] <= 1 for r in rules if r["task"] == "recall")
    loss = {(r["task"], r["attn"], r["seed"], r["sa_rule"]): r["val_loss"] for r in rules}
    assert all(loss[t, k, s, "rank"] != loss[t, k, s, "value"] for t, k, s, _ in loss)  # --sa_rule reached the model
    demo = json.loads((out / "demo.json").read_text())  # issue 46: the class demo's three kinds, its reach
    assert {r["attn"] for r in demo["runs"]} == {"swa", "sa+swa", "full"} and demo["swa_reach"] < demo["min_gap"]
    assert all(0 <= r["val_acc"] <= 1 and r["wall_s"] > 0 for r in demo["runs"])
    for path in out.glob("*.json"):  # each row records the commit and the command that wrote it
        assert all(re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", r["commit"]) and r["command"].startswith(
            "python results/") for r in result_rows(json.loads(path.read_text()))), path.name
    summary = (out / "summary.md").read_text()
    for section in ("figure", "lm", "swap", "mqar_search", "mqar", "mqar_decisive", "recall_swap", "coverage", "speed",
                    "sa_rules", "lm1024", "demo"):
        assert f"## {section} (" in summary


def test_train_all_resumes_only_a_checkpoint_of_the_same_args(tmp_path):
    """An unfinished run continues only from a checkpoint whose settings have every arg of the run."""
    from dataclasses import asdict

    from checkpoint import save_checkpoint
    from model import GPT, GPTConfig
    args = dict(presets=["config/mqar.py"], attn="sa+swa", seed=1, learning_rate=0.0003, decay_lr=True)
    assert not common.resumable(str(tmp_path), args)                     # no checkpoint yet
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8, attn="sa+swa")
    save_checkpoint(dict(model=GPT(config).state_dict(), model_args=asdict(config),
                         settings=dict(attn="sa+swa", seed=1, learning_rate=3e-4, decay_lr=True, beta2=0.95)),
                    str(tmp_path / "ckpt.pt"))
    assert common.resumable(str(tmp_path), args)                         # values compare as train.py parses them
    assert not common.resumable(str(tmp_path), {**args, "seed": 2})
    assert not common.resumable(str(tmp_path), {**args, "beta2": 0.999})


def test_a_rebuilt_row_keeps_its_commit_only_with_its_numbers():
    known = [dict(attn="sa", loss=1.5, commit="abc1234"), dict(attn="swa", loss=1.2, commit="def5678", command="c")]
    assert stamp(dict(attn="swa", loss=1.2), known) == known[1] and stamp(dict(attn="sa", loss=1.5), known) == known[0]
    assert stamp(dict(attn="sa", loss=1.4), known) == dict(attn="sa", loss=1.4, **provenance())
    assert provenance()["command"].startswith("python ")


def test_lm1024_rebuilds_its_committed_tables(tmp_path):
    """`--only=lm1024 --train=False` where no run's checkpoint is (any machine but the one that trained them)
    writes back the committed lm1024.json, the 12,000-iteration runs and every row's commit included, and summary.md's
    lm1024 section as committed. Not compared: the counts of the plain LM's val tokens, which follow Python's own
    standard library (pystdlib)."""
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(os.path.join(REPO, "results", "lm1024.json"), out)
    r = subprocess.run([sys.executable, "results/reproduce.py", "--only=lm1024", "--train=False", f"--out={out}",
                        f"--work={tmp_path / 'work'}"], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(REPO, "results", "lm1024.json")) as f:
        committed = json.load(f)
    assert dict(json.loads((out / "lm1024.json").read_text()), split_tokens=0) == dict(committed, split_tokens=0)

    def section(text):  # summary.md's lm1024 section, without its token counts
        return [line for line in text.split("\n## lm1024 (")[1].split("\n## ")[0].splitlines()[1:]
                if not line.startswith("tokens: ")]
    with open(os.path.join(REPO, "results", "summary.md")) as f:
        assert section((out / "summary.md").read_text()) == section(f.read())
