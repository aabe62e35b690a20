"""The miniature reproduction's pipeline, end to end in its --fast mode (a couple of minutes),
so that results/reproduce.py cannot rot. Run: python -m pytest -q test_reproduce.py"""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.abspath(__file__))


def test_reproduce_fast_writes_every_result(tmp_path):
    out, work = tmp_path / "results", tmp_path / "work"
    r = subprocess.run([sys.executable, "results/reproduce.py", "--fast=True", f"--out={out}", f"--work={work}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for png in ("sa_picture", "lm", "swap", "mqar", "recall_swap", "coverage"):
        assert (out / f"{png}.png").stat().st_size > 1000, png
    kinds = {"full", "swa", "sa", "sa+swa", "moba"}
    mqar = json.loads((out / "mqar.json").read_text())
    assert {r["attn"] for r in mqar["runs"]} == kinds and all(0 <= r["val_acc"] <= 1 for r in mqar["runs"])
    assert {r["cell"] for r in mqar["runs"]} == kinds | {"sa+swa-head", "full-4heads"}
    assert [(a["cell"], sorted(a["accs"])) for a in mqar["permutation_average"]] == [
        (c, ["1", "16", "4"]) for c in ("sa", "sa+swa", "sa+swa-head")]  # logits averaged over 1, 4 and 16 draws
    assert mqar["predicted_reachable"]["swa/2"] == 0 and mqar["predicted_reachable"]["full/2"] == 1
    assert mqar["predicted_reachable"]["sa+swa-head/2"] > mqar["predicted_reachable"]["sa+swa/2"]  # 4 permutations
    search = json.loads((out / "mqar_search.json").read_text())
    assert len(search["runs"]) > 1 and all(0 <= r["val_acc"] <= 1 for r in search["runs"])
    recall = json.loads((out / "recall_swap.json").read_text())
    assert {r["attn"] for r in recall["runs"]} == {"swa", "sa", "moba"} and 0 <= recall["full"] <= 1
    lm = json.loads((out / "lm.json").read_text())
    assert {r["attn"] for r in lm["runs"]} == kinds - {"moba"}
    assert all(len(curve) >= 2 for curve in lm["curves"].values())
    swap = json.loads((out / "swap.json").read_text())["results"]
    assert {r["attn"] for r in swap} == {"full", "swa", "sa", "moba"}
    speed = json.loads((out / "speed_cpu.json").read_text())
    assert {r["kind"] for r in speed["rows"]} == {"full", "swa", "sa", "moba"}
    rules = json.loads((out / "sa_rules.json").read_text())["runs"]
    assert {(r["task"], r["attn"], r["sa_rule"]) for r in rules} == {
        (t, k, u) for t in ("lm", "recall") for k in ("sa", "sa+swa") for u in ("rank", "value")}
    assert all(0 <= r["val_acc"] <= 1 for r in rules if r["task"] == "recall")
    loss = {(r["task"], r["attn"], r["seed"], r["sa_rule"]): r["val_loss"] for r in rules}
    assert all(loss[t, k, s, "rank"] != loss[t, k, s, "value"] for t, k, s, _ in loss)  # --sa_rule reached the model
    summary = (out / "summary.md").read_text()
    for section in ("figure", "lm", "swap", "mqar_search", "mqar", "recall_swap", "coverage", "speed", "sa_rules"):
        assert f"## {section} (" in summary
