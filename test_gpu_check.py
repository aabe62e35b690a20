"""Tests for gpu_check.py on the CPU: its one line without a GPU, and its speed and training stages
run here at tiny sizes (the parts that do not need a GPU). Run: python -m pytest -q test_gpu_check.py"""
import os
import subprocess
import sys

import pytest
import torch

import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: run gpu_check.py itself")
def test_no_gpu_stops_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "gpu_check.py", f"--out={tmp_path}/check.json"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in (out.stdout + out.stderr).splitlines() if not line.startswith("overriding")]
    assert out.returncode == 1 and len(lines) == 1 and "needs a CUDA GPU" in lines[0], out.stdout + out.stderr
    assert not os.listdir(tmp_path)


def test_bench_stage_reports_full_over_sa(monkeypatch):
    """bench.py's table comes back as rows and full/sa ratios beside the paper's (T=2048: 1.5x)."""
    monkeypatch.setattr(gpu_check, "sizes", "2048")
    monkeypatch.setattr(gpu_check, "bench_args", "--batch=1 --heads=1 --head_dim=16 --reps=1 --threads=1")
    record = gpu_check.bench_stage("cpu", ["--kinds=full,sa", "--modes=fwd"])
    assert record["status"] == "pass", record["output"]
    assert [(r["mode"], r["T"], r["kind"]) for r in record["rows"]] == [("fwd", 2048, "full"), ("fwd", 2048, "sa")]
    (ratio,) = record["full_over"]
    assert ratio["kind"] == "sa" and ratio["ratio"] > 0 and ratio["paper_sa"] == 1.5


def test_train_stage_on_random_tokens(monkeypatch):
    """train.py reads the random-token dataset, and its logged speeds become tok/s (no MFU off CUDA)."""
    monkeypatch.setattr(gpu_check, "train_args", "--n_layer=1 --n_head=2 --n_embd=32 --block_size=64 "
                        "--batch_size=2 --gradient_accumulation_steps=1 --device=cpu --dtype=float32")
    record = gpu_check.train_stage("sa+swa", "cpu", iters=4, extra=["--window=8"])
    assert record["status"] == "pass", record["output"]
    assert record["tok_per_s"] > 0 and record["mfu"] is None and record["mfu_of_a100_peak"] is None
