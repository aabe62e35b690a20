"""Tests for receptive_field.py. Run: python -m pytest -q tests/test_receptive_field.py"""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import attention as A
import receptive_field as rf


def dense(R, n):
    """(n, n) bool from the packed bitsets: [i, j] = token j has reached token i."""
    return np.unpackbits(R.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)


def graph_mask(n, keys, count):
    m = np.zeros((n, n), bool)
    for i in range(n):
        m[i, keys[i, :count[i]]] = True
    return m


def attention_mask(n, window, kind, setting, draws, sa_rule):
    """The same layer from attention.py's dense references; bidirectional drops the causal rule: m | m.T."""
    m = torch.zeros(n, n, dtype=torch.bool)
    if kind != "sa":
        m |= A.swa_mask(n, window)
    for d in draws if kind != "swa" else []:
        d = torch.from_numpy(d)
        m |= A.sa_mask(window, d) if sa_rule == "rank" else A.sa_value_mask(window / n, d)
    m = m.numpy()
    return m | m.T if setting == "bidirectional" else m


@pytest.mark.parametrize("sa_rule", rf.SA_RULES)
@pytest.mark.parametrize("setting", rf.CHECKS)
@pytest.mark.parametrize("kind", rf.KINDS)
def test_layers_follow_attention_rules(kind, setting, sa_rule, monkeypatch):
    """One layer's graph is attention.py's mask; L layers compose to the boolean product of the masks.
    n=150 spans three words; tiny pieces of rows make many."""
    monkeypatch.setattr(rf, "PIECE_WORDS", 200)
    n, window, rng = 150, 5, np.random.default_rng(0)
    R, want = rf.identity_bits(n), np.eye(n, dtype=bool)
    for layer in range(3):
        draws = [rng.permutation(n) if sa_rule == "rank" else rng.random(n) for _ in range(2)]  # two heads
        keys, count = rf.layer_graph(n, window, kind, setting, draws, sa_rule)
        mask = attention_mask(n, window, kind, setting, draws, sa_rule)
        assert np.array_equal(graph_mask(n, keys, count), mask)
        assert np.array_equal(count, mask.sum(1))                     # keys are distinct
        R = rf.apply_layer(R, keys, count, setting == "causal")
        want = (mask.astype(np.int64) @ want.astype(np.int64)) > 0    # i hears j via some key of i
        assert np.array_equal(dense(R, n), want), f"layer {layer + 1}"


@pytest.mark.parametrize("setting", rf.CHECKS)
@pytest.mark.parametrize("n,window", [(2, 2), (10, 3), (64, 8), (65, 8), (100, 7), (257, 16), (300, 64), (50, 64)])
def test_swa_needs_exactly_ceil_n_minus_1_over_w_minus_1_layers(n, window, setting):
    res = rf.measure(n, window, "swa", setting, max_layers=500)
    exact = math.ceil((n - 1) / (window - 1))
    assert res["all_pairs"] == res["last_token"] == [exact] == [res["swa_exact"]]
    # after L layers token i has heard the min(i, L(w-1)) tokens before it (and, bidirectional, as many after)
    heard = np.minimum(np.arange(exact + 1)[:, None] * (window - 1), np.arange(n)).sum(1)  # (L+1,)
    assert res["covered"][0] == list(n + heard * (1 if setting == "causal" else 2))
    assert res["covered"][0][-1] == res["pairs"] == (n * (n + 1) // 2 if setting == "causal" else n * n)


@pytest.mark.parametrize("sa_rule", rf.SA_RULES)
def test_bidirectional_sa_covers_in_about_log_w_n_layers(sa_rule):
    n, window = 4096, 16
    res = rf.measure(n, window, "sa", "bidirectional", seeds=5, max_layers=20, sa_rule=sa_rule)
    bound = 2 * math.log(n, window) + 2                               # 8 layers; SWA needs 273
    assert sum(x is not None and x <= bound for x in res["all_pairs"]) >= 4, res["all_pairs"]


@pytest.mark.parametrize("sa_rule", rf.SA_RULES)
def test_causal_sa_plus_swa_covers_far_faster_than_swa_and_than_pure_sa(sa_rule):
    n, window = 1024, 16
    swa = rf.measure(n, window, "swa", "causal", max_layers=100)["all_pairs"][0]
    both = rf.measure(n, window, "sa+swa", "causal", seeds=3, max_layers=20, sa_rule=sa_rule)["all_pairs"]
    assert swa == 69 and all(x is not None and 5 * x <= swa for x in both), both
    # pure causal SA: tokens i-1 and i only meet through a direct edge, probability ~2w/n per layer
    sa = rf.measure(n, window, "sa", "causal", seeds=3, max_layers=20, sa_rule=sa_rule)
    assert sa["all_pairs"] == [None] * 3 and all(c[-1] < sa["pairs"] for c in sa["covered"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="ssa"), "kind must be one of"),
    (dict(setting="circular"), "setting must be one of"),
    (dict(window=1), "window must be an integer >= 2"),
    (dict(window=4.0), "window must be an integer >= 2"),
    (dict(heads=0), "heads must be an integer >= 1"),
    (dict(sa_rule="slot"), "sa_rule must be one of"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    args = dict(n=64, window=4, kind="sa", setting="causal") | kwargs
    with pytest.raises(ValueError, match=match):
        rf.measure(**args)


@pytest.mark.parametrize("arg,match", [("--kind=bogus", "kind must be one of"), ("--windw=3", "windw"),
                                       ("--window=x", "window"),
                                       ("--grid=True --grid_n=1k", "--grid_n is a comma list"),
                                       ("--grid=True --grid_runs=sa", "--grid_runs is a comma list of setting:kind")])
def test_cli_bad_input_is_one_line(arg, match):
    p = subprocess.run([sys.executable, "results/receptive_field.py", *arg.split()], capture_output=True, text=True)
    assert p.returncode != 0 and match in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_grid_writes_table_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cov.json"
    p = subprocess.run([sys.executable, "results/receptive_field.py", "--grid=True", "--grid_n=64,128",
                        "--grid_window=4,8", "--seeds=2", f"--json_out={out}", f"--plot={tmp_path / 'cov.png'}"],
                       capture_output=True, text=True, check=True)
    assert p.stdout.count("| causal | sa+swa |") == 4 and "| bidirectional | sa |" in p.stdout
    res = json.loads(out.read_text())["results"]
    assert len(res) == 16 and all(len(r["covered"]) == (1 if r["kind"] == "swa" else 2) for r in res)
    assert all(r["command"].startswith("python results/receptive_field.py --grid=True --grid_n=64,128") and r["commit"]
               for r in res)  # issue 56: each row says where it comes from
    assert (tmp_path / "cov.png").stat().st_size > 0


def cli(*args):
    return subprocess.run([sys.executable, "results/receptive_field.py", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_says_memory_up_front_and_refuses_what_cannot_fit(tmp_path):
    p = cli("--n=1000000")
    assert p.returncode != 0 and "Traceback" not in p.stderr and not p.stdout, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("receptive_field.py: n=1000000 needs 232.8 GiB")
    p = cli("--n=64", "--seeds=1")
    assert p.returncode == 0 and "n=64: 0.00 MiB of bitsets (of " in p.stderr  # 2 x 64 x 8 bytes


def test_large_runs_show_each_layers_progress(monkeypatch, capsys):
    assert rf.bitset_bytes(200000) >= rf.PROGRESS_BYTES > rf.bitset_bytes(16384)  # n=200000 shows it, the grid not
    monkeypatch.setattr(rf, "PROGRESS_BYTES", rf.bitset_bytes(64))
    layers = rf.simulate(64, 8, "swa", "causal", 1, 64, 0)[0]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == layers == 9 and lines[-1].startswith("causal swa n=64 w=8 seed 0: layer 9, 1.0000 of pairs")


@pytest.mark.parametrize("where, match", [("/sys/cov.json", "cannot write to /sys/cov.json (Permission denied"),
                                          ("/dev/full", "cannot write /dev/full: No space left on device")])
def test_cli_unwritable_output_is_one_line(where, match):
    """A read-only place stops the run before the computation; a full disk after the table."""
    if not __import__("os").path.exists(where.rsplit("/", 1)[0] if where != "/dev/full" else where):
        pytest.skip(f"no {where} here")
    p = cli("--n=64", "--seeds=1", f"--json_out={where}")
    assert p.returncode != 0 and "Traceback" not in p.stderr and match in p.stderr.strip().splitlines()[-1], p.stderr
    assert ("| causal |" in p.stdout) == (where == "/dev/full")
