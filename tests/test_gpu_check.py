"""Tests for gpu_check.py on the CPU: its one line without a GPU, and every stage run here at tiny sizes (the kernel's
on its interpreter), its time limits, and where its results go. Run: python -m pytest -q tests/test_gpu_check.py"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import gpu_check

ROOT = gpu_check.ROOT
# the interpreter also computes padding rows past T, which may see no key (0 / 0); they are never stored
interpreter_rows = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: run gpu_check.py itself")
def test_no_gpu_stops_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "results/gpu_check.py", f"--out={tmp_path}/check.json"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [line for line in (out.stdout + out.stderr).splitlines() if not line.startswith("overriding")]
    assert out.returncode == 1 and len(lines) == 1 and "needs a CUDA GPU" in lines[0], out.stdout + out.stderr
    assert not os.listdir(tmp_path)


def test_run_kills_a_stage_at_its_limit_and_stops_one_early():
    """A stage and the processes it started are killed at the limit (status timeout, its output kept); stop() ends a
    command early, as a pass."""
    code = ("import subprocess, sys, time; print('started', flush=True); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(p.pid, flush=True); "
            "time.sleep(60)")
    start = time.time()
    record = gpu_check.run([sys.executable, "-c", code], 2)
    assert record["status"] == "timeout" and time.time() - start < 20 and "started" in record["output"]
    grandchild = int(record["output"].split()[1])
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{grandchild}") or "Z" in open(f"/proc/{grandchild}/stat").read().split()[2]
    record = gpu_check.run([sys.executable, "-c", "import time; time.sleep(60)"], 50, stop=lambda: True)
    assert record["status"] == "pass" and record["seconds"] < 20


def test_a_stage_counts_graph_breaks():
    code = "import torch; torch.compile(lambda x: torch._dynamo.graph_break() or x + 1, backend='eager')(torch.ones(1))"
    record = gpu_check.run([sys.executable, "-c", code], 60)
    assert record["status"] == "pass" and record["graph_breaks"] == 1, record["output"]


def test_results_go_to_OUT_and_an_earlier_run_stays(monkeypatch, tmp_path):
    """$OUT/gpu_check.json where OUT is set (--out first); a file of one run (the old format) or of runs is read as its
    runs, to which this run is added."""
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.results_path() == str(tmp_path / "gpu_check.json")
    monkeypatch.setattr(gpu_check, "out", str(tmp_path / "x.json"))
    assert gpu_check.results_path() == str(tmp_path / "x.json")
    monkeypatch.delenv("OUT")
    monkeypatch.setattr(gpu_check, "out", "")
    assert gpu_check.results_path() == os.path.join(ROOT, "results", "gpu_check.json")
    old = json.load(open(os.path.join(ROOT, "results", "gpu_check.json")))
    assert gpu_check.earlier_runs(os.path.join(ROOT, "results", "gpu_check.json")) in ([old], old.get("runs"))
    gpu_check.writer(str(tmp_path / "r.json"))(dict(runs=[{"stages": {}}, {"stages": {"speed": {}}}]))
    assert gpu_check.earlier_runs(str(tmp_path / "r.json"))[1] == {"stages": {"speed": {}}}
    assert gpu_check.earlier_runs(str(tmp_path / "none.json")) == [] and os.listdir(tmp_path) == ["r.json"]


def test_limits_add_up_to_the_budget():
    """Every stage has a limit; with the train stage's 4 runs they add up to the budget, 7 minutes."""
    limits = gpu_check.stage_limits()
    runs = 2 * len(gpu_check.train_runs.split(","))
    assert set(limits) == set(gpu_check.STAGES)
    assert sum(limits.values()) + (runs - 1) * limits["train"] <= gpu_check.budget == 420


def test_provenance_takes_the_commit_given(monkeypatch):
    """The GPU machine's copy has no .git: --commit names the commit every record carries."""
    monkeypatch.setattr(gpu_check, "commit", "1a2b3c4")
    assert gpu_check.provenance_now()["commit"] == "1a2b3c4"


def test_bench_stage_reports_full_over_sa_and_the_base(monkeypatch):
    """bench.py's table comes back as rows, full/sa beside the paper's (T=2048: 1.5x), and this tree's time over the
    base's (here the base is this tree)."""
    monkeypatch.setattr(gpu_check, "sizes", "2048")
    monkeypatch.setattr(gpu_check, "bench_kinds", "full,sa")
    monkeypatch.setattr(gpu_check, "base", ROOT)
    monkeypatch.setattr(gpu_check, "bench_args", "--batch=1 --heads=1 --head_dim=16 --reps=1 --threads=1 --rounds=1")
    record = gpu_check.bench_stage(300, ["--modes=fwd"])
    assert record["status"] == "pass", record["output"]
    assert [r["kind"] for r in record["rows"]] == ["full", "base:sa", "sa"]
    (ratio,) = record["full_over"]
    assert ratio["kind"] == "sa" and ratio["ratio"] > 0 and ratio["paper_sa"] == 1.5
    assert [(r["kind"], r["ratio"] > 0) for r in record["over_base"]] == [("sa", True)]


@interpreter_rows
def test_compile_stage_runs_each_job_in_a_fresh_process(monkeypatch):
    """Each warm-up job runs its kernel calls in a process of its own; a job that fails is a line, not a crash."""
    jobs = [(ROOT, "kernel", ("float32", "sa rank", 40, 8)), (ROOT, "sweep", (5, 40, "sa", 16, 8)),
            (ROOT, "kernel", ("float8", "swa", 40, 8))]
    monkeypatch.setattr(gpu_check, "compile_jobs", lambda: jobs)
    record = gpu_check.compile_stage(workers=2)
    assert record["jobs"]["kernel float32 sa rank 40 8"] == "pass" and record["jobs"]["sweep 5 40 sa 16 8"] == "pass"
    assert record["status"] == "fail" and "float8" in record["jobs"]["kernel float8 swa 40 8"], record
    assert "2 of 3 jobs" in record["output"]


def test_compile_jobs_cover_the_stages_after(monkeypatch):
    """The self-check's rules in both dtypes, kernel.py --check's, each candidate's kinds once per specialisation of
    T, and the base's kinds."""
    monkeypatch.setattr(gpu_check, "base", "/base")
    jobs = gpu_check.compile_jobs()
    assert sum(what == "self-check" for _, what, _ in jobs) == 6 and sum(what == "kernel" for _, what, _ in jobs) == 3
    sweeps = {args for _, what, args in jobs if what == "sweep"}
    assert sweeps == {(i, 8192, kind, 64, 256) for i in range(1, len(gpu_check.CANDIDATES))
                      if i not in gpu_check.SM90_ONLY for kind in gpu_check.SWEEP_KINDS}  # this CPU: no sm_90
    assert [args for root, _, args in jobs if root == "/base"] == [("swa",), ("sa",), ("sa-value",)]


def test_self_check_stage_times_each_rule(monkeypatch):
    """A line for each rule and dtype, as check_once runs it (here its self-check stubbed: the value rule fails)."""
    import kernel
    monkeypatch.setattr(kernel, "SELF_CHECKS", {})
    monkeypatch.setattr(kernel, "self_check", lambda *case, margin: 1.0 if case[3] == "sa value" else 1e-7)
    record = gpu_check.self_check_stage(D=16, dtypes=(torch.float32, torch.float16))
    lines = record["output"].splitlines()
    assert record["status"] == "fail" and len(lines) == 6 and "memory" not in record, record  # no GPU: no micro-step
    assert all(" head dim 16: max err 1.0e-07 in " in line for line in lines if "sa value" not in line), lines
    assert lines[2].startswith("self-check sa value  float32 head dim 16: FAILED: the Triton kernel failed"), lines


def test_kernel_stage(monkeypatch):
    monkeypatch.setattr(gpu_check, "check_T", "40")
    monkeypatch.setattr(gpu_check, "check_windows", "8")
    monkeypatch.setattr(gpu_check, "check_dtypes", "float32")
    monkeypatch.setattr(gpu_check, "check_heads", 2)
    record = gpu_check.kernel_stage(300)
    assert record["status"] == "pass" and record["output"].count("PASS") == 4, record["output"]


@interpreter_rows
def test_sweep_in_a_child_times_each_candidate():
    """The sweep as gpu_check.py runs it, in a child process: a row per candidate, out and gradients equal to today's
    tiling's, and the profiler's table."""
    settings = ["--sweep_sizes=40", "--sweep_shape=1,2,16,8", "--candidates=0,1,8", "--sweep_reps=1"]
    record = gpu_check.in_child("sweep", 300, settings)
    assert record["status"] == "pass", record["log"]
    assert [r["candidate"] for r in record["rows"]] == [gpu_check.CANDIDATES[i] for i in (0, 1, 8)]
    assert all(r["ok"] and r["sa-value diff"] < 1e-5 and r["sa bwd ms"] > 0 for r in record["rows"]), record["rows"]
    assert "Self CPU" in record["output"]  # the profiler's table


@interpreter_rows
def test_sweep_catches_a_candidate_with_a_wrong_backward(monkeypatch):
    """A candidate whose forward is right and whose dq is 10% off fails the sweep: it checks gradients too."""
    import kernel
    backward = kernel._backward

    def faulty(*args):
        dq, dk, dv = backward(*args)
        return (dq * 1.1 if args[-1].dq_atomic else dq), dk, dv
    monkeypatch.setattr(kernel, "_backward", faulty)
    for name, value in (("sweep_sizes", "40"), ("sweep_shape", "1,2,16,8"), ("candidates", "0,5"), ("sweep_reps", 1)):
        monkeypatch.setattr(gpu_check, name, value)
    record = gpu_check.sweep_stage()
    assert record["status"] == "fail" and [r["ok"] for r in record["rows"]] == [True, False], record["rows"]


def test_train_stage_stops_after_the_first_timed_iterations(monkeypatch):
    """train.py reads the random-token dataset, logs a speed every iteration, and is stopped after train_iters of them
    (beyond the first): it never reaches its end, where it would evaluate and save; no MFU off CUDA."""
    monkeypatch.setattr(gpu_check, "train_args", "--n_layer=1 --n_head=2 --n_embd=32 --gradient_accumulation_steps=1 "
                        "--device=cpu --dtype=float32 --window=8")
    monkeypatch.setattr(gpu_check, "train_iters", 2)
    record = gpu_check.train_stage("sa+swa", "cpu", 300, ["--block_size=64", "--batch_size=2"])
    assert record["status"] == "pass" and "done:" not in record["output"], record["output"]
    assert record["tok_per_s"] > 0 and record["mfu"] is None and record["mfu_of_a100_peak"] is None


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


@interpreter_rows
def test_memory_estimate_of_the_saved_activations(monkeypatch):
    """What the forward saves for the backward (SA+SWA through the kernel, here its interpreter; bf16 autocast),
    measured with saved-tensor hooks, within 5% of memory_estimate's saved activations."""
    import attention
    import kernel
    from model import GPT, GPTConfig
    monkeypatch.setattr(attention, "ATTN_ENGINE", "triton")
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
