"""Tests for gpu_check.py on the CPU: its one line without a GPU, and its speed and training stages
run here at tiny sizes (the parts that do not need a GPU). Run: python -m pytest -q tests/test_gpu_check.py"""
import os
import subprocess
import sys

import pytest
import torch

import bench
import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: run gpu_check.py itself")
def test_no_gpu_stops_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "results/gpu_check.py", f"--out={tmp_path}/check.json"], capture_output=True,
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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes rows past T too (0 / 0)
def test_sweep_stage_times_each_tiling(monkeypatch):
    """The sweep on the kernel's interpreter, tiny: a row per tiling (the one in use first), SWA's and SA's outputs
    equal to the tiling in use's, and the profiler's table; a tiling that cannot run is a row that says why."""
    monkeypatch.setattr(gpu_check, "sweep_T", 70)
    monkeypatch.setattr(gpu_check, "TILINGS", [(32, 16, 32, 16, 4, 2), (16, 16, 16, 16, 4, 2), (48, 16, 32, 16, 4, 2)])
    monkeypatch.setattr(bench, "device_ms", lambda fn: [fn(), 1.0][1])  # no CUDA events here
    record = gpu_check.sweep_stage(B=1, H=2, D=16, window=8, dtype=torch.float32, device="cpu")
    assert record["status"] == "pass" and [r["tiling"] for r in record["rows"]] == gpu_check.TILINGS
    ok, bad = record["rows"][:2], record["rows"][2]
    assert all(r[f"{kind} diff"] < 1e-5 and r[f"{kind} fwd+bwd ms"] == 1.0 for r in ok for kind in ("swa", "sa"))
    assert "power of 2" in bad["error"] and "_BandBackward" in record["output"]  # the table: SA fwd+bwd


def test_train_stage_on_random_tokens(monkeypatch):
    """train.py reads the random-token dataset, and its logged speeds become tok/s (no MFU off CUDA). Compiled
    training on the CPU: pytest --slow tests/test_train.py -k compiled."""
    monkeypatch.setattr(gpu_check, "train_args", "--n_layer=1 --n_head=2 --n_embd=32 --block_size=64 "
                        "--batch_size=2 --gradient_accumulation_steps=1 --device=cpu --dtype=float32")
    record = gpu_check.train_stage("sa+swa", "cpu", iters=4, extra=["--window=8"])
    assert record["status"] == "pass", record["output"]
    assert record["tok_per_s"] > 0 and record["mfu"] is None and record["mfu_of_a100_peak"] is None


def test_a_stage_counts_graph_breaks():
    code = "import torch; torch.compile(lambda x: torch._dynamo.graph_break() or x + 1, backend='eager')(torch.ones(1))"
    record = gpu_check.run([sys.executable, "-c", code], 60)
    assert record["status"] == "pass" and record["graph_breaks"] == 1, record["output"]


def test_memory_estimate_counts_the_states_exactly():
    """memory_estimate's states: fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    x = torch.randint(128, (2, 65))
    model(x[:, :-1], x[:, 1:])[1].backward()
    optimizer.step()
    params = list(model.parameters())
    states = params + [p.grad for p in params] + [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    n = sum(p.numel() for p in params)
    assert sum(t.numel() * t.element_size() for t in states) == gpu_check.memory_estimate(n, 2, 32, 128, 2, 64)[0]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes rows past T too (0 / 0)
def test_memory_estimate_of_the_saved_activations(monkeypatch):
    """What the forward saves for the backward (SA+SWA through the kernel, here its interpreter; bf16 autocast),
    measured with saved-tensor hooks, within 5% of memory_estimate's saved activations."""
    import attention
    import kernel
    from model import GPT, GPTConfig
    monkeypatch.setattr(attention, "ENGINE", "triton")
    monkeypatch.setattr(kernel, "SELF_CHECK", False)  # the interpreter's bf16 dot is wrong; bytes are not
    L, C, T, B, V = 3, 128, 256, 2, 1024
    model = GPT(GPTConfig(n_layer=L, n_head=2, n_embd=C, block_size=T, vocab_size=V))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:  # the bf16 copies of the weights count, not the weights
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randint(V, (B, T + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x[:, :-1], x[:, 1:])
    estimate = gpu_check.memory_estimate(sum(p.numel() for p in model.parameters()), L, C, V, B, T)[1]
    assert sum(saved.values()) == pytest.approx(estimate, rel=0.05)
