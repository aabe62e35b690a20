"""Tests for bench.py: its fair FlexAttention peers compute SWA and SA, through a BlockMask that lists
only the key blocks the band reaches; bad settings, all checked up front, stop with one line;
--json_out is written whole. Run: python -m pytest -q tests/test_bench.py"""
import json
import os
import subprocess
import sys

import pytest
import torch

import attention as A
import bench
from test_attention import qkv


@pytest.mark.parametrize("arg, problem", [("--reps=0", "reps=0: use an integer >= 1"),
                                          ("--sizes=0", "sizes='0': give sequence lengths >= 1"),
                                          ("--kinds=flex", "kinds='flex': unknown kind 'flex'"),
                                          ("--threads=0", "threads=0: use an integer >= 1"),
                                          ("--window=0", "window=0: use an integer >= 1"),
                                          ("--thp=2", "thp=2: use 1 (huge pages) or 0"),
                                          ("--device=foo", "device='foo': use cpu, cuda or cuda:N"),
                                          ("--json_out=/sys/b/r.json", "json_out='/sys/b/r.json': cannot write to /sys/b/r.json (Permission"),
                                          ("--json_out=results", "json_out='results': it is a directory"),
                                          ("--case=foo", "case='foo': use kind,mode,T"),
                                          ("--case=sa,fwd,x", "case='sa,fwd,x': use kind,mode,T"),
                                          ("--batch=-1", "batch=-1: use an integer >= 1"),
                                          ("--base=/nowhere", "base='/nowhere' holds no attention.py")])
def test_bad_settings_stop_with_one_line(arg, problem):
    out = subprocess.run([sys.executable, "results/bench.py", arg], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if not line.startswith("overriding")]
    assert out.returncode == 1 and len(lines) == 1 and lines[0].removeprefix("bench.py: ").startswith(problem), text


def test_json_out_is_written_whole(tmp_path):
    """The table goes to --json_out (its directory made), by a rename: no .tmp stays behind."""
    out = tmp_path / "res" / "speed.json"
    r = subprocess.run([sys.executable, "results/bench.py", "--sizes=64", "--kinds=full,swa", "--modes=fwd", "--reps=1",
                        "--window=8", f"--json_out={out}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [row["kind"] for row in json.loads(out.read_text())["rows"]] == ["full", "swa"]
    assert os.listdir(out.parent) == ["speed.json"]


def test_generation_command_prints_every_kind(monkeypatch, capsys):
    """`results/bench.py --generation=True` as README runs it, with generate cut to a few 4-token forwards (the real
    prompts take minutes): every kind gets its row, rank-rule SA without a cache."""
    import runpy

    from model import GPT
    monkeypatch.setattr(GPT, "generate", lambda self, idx, n, **_: [self(idx[:, :4]) for _ in range(n)])
    monkeypatch.setattr(sys, "argv", ["bench.py", "--generation=True"])
    with pytest.raises(SystemExit):
        runpy.run_path("results/bench.py", run_name="__main__")
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:-1]]
    assert [r[0] for r in rows[::3]] == ["full", "swa", "sa", "sa+swa", "moba", "sa", "sa+swa"], rows
    assert sum(r[-1] == "n/a" for r in rows) == 6 and all(r[-1].endswith("x") for r in rows if r[-1] != "n/a"), rows


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose, see below
@pytest.mark.parametrize("kind", ["flex-swa", "flex-sa"])
def test_fair_flex_peers_match_the_references(monkeypatch, kind):
    """At T = 300 (no multiple of Flex's 128-token blocks), window 100: the output equals the dense
    reference, and each query block lists only the key blocks its band reaches (SWA: itself and one
    before; SA: one on each side), so Flex does O(T * window) work. Eager flex_attention here: the
    same BlockMask as compiled, without the minutes of compiling on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention
    compile_ = torch.compile  # bench's torch.compile(flex_attention, dynamic=False) becomes eager; Flex's own stay
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn if fn is flex_attention else compile_(fn, **options))
    monkeypatch.setattr(bench, "window", 100)
    T = 300
    torch.manual_seed(0)
    fn = bench.attention_fn(kind, T)
    torch.manual_seed(0)
    perm = torch.randperm(T)  # the one attention_fn drew
    q, k, v = (t.detach() for t in qkv(1, 2, T, 16))  # forward only: Flex has no CPU backward
    want = A.swa_reference(q, k, v, 100) if kind == "flex-swa" else A.sa_reference(q, k, v, 100, perm)
    torch.testing.assert_close(fn(q, k, v), want, atol=1e-5, rtol=1e-5)
    band = (0, 99, lambda b, h, s, t: (t <= s) & (s - t < 100), True) if kind == "flex-swa" else \
        (-99, 99, lambda b, h, s, t: (s - t).abs() < 100, False)
    mask = bench.band_block_mask(T, *band)
    listed = mask.kv_num_blocks + (mask.full_kv_num_blocks if mask.full_kv_num_blocks is not None else 0)
    assert listed.flatten().tolist() == ([1, 2, 2] if kind == "flex-swa" else [2, 3, 2])


def test_same_ops_finds_no_difference_against_itself_and_refuses_a_bad_base(tmp_path):
    """results/same_ops.py, the refactor check: this checkout against itself runs the same ops for every kind."""
    r = subprocess.run([sys.executable, "results/same_ops.py", "--base=."], capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    rows = [line.split() for line in lines[[line.split()[0] for line in lines].index("kind") + 1:]]
    assert r.returncode == 0 and len(rows) == 6 and all(row[-1] == "0" and row[-2] == row[-3] for row in rows), r
    r = subprocess.run([sys.executable, "results/same_ops.py", f"--base={tmp_path}"], capture_output=True, text=True)
    assert r.returncode == 1 and "holds no attention.py" in r.stderr.strip().splitlines()[-1]


def test_a_base_checkout_runs_beside_this_one(tmp_path):
    """bench.Checkout (--base on a GPU: base and this tree alternately in one process): the base's attention.py and its
    modules, its kernel imported from the base too; this tree's modules untouched before, during and after. In a
    process of its own: the base's kernel.py re-registers the torch ops of ours."""
    import shutil
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in os.listdir(root):
        if name.endswith(".py"):
            shutil.copy(os.path.join(root, name), tmp_path / name)
    code = f"""if True:
        import sys, torch
        sys.path[:0] = [{root!r}, {os.path.join(root, "results")!r}]
        import attention as A, bench, kernel
        ours = dict(sys.modules)
        base = bench.Checkout({str(tmp_path)!r})
        assert base.A is not A and base.A.__file__ == {str(tmp_path / "attention.py")!r}
        assert all(sys.modules.get(n) is ours.get(n) for n in base.modules) and "kernel" in base.modules
        q, k, v = torch.randn(3, 1, 2, 40, 16).unbind()
        with base as attention:
            assert sys.modules["kernel"].__file__ == {str(tmp_path / "kernel.py")!r} and attention is base.A
            got = attention.sliding_window_attention(q, k, v, 8)
        assert all(sys.modules.get(n) is ours.get(n) for n in base.modules)
        torch.testing.assert_close(got, A.sliding_window_attention(q, k, v, 8))
        print("ok")"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
