"""The write-up is its JSON: results/README.md's tables and verdicts, README.md's Results bullets and results/summary.md
are what results/report.py renders from the committed JSON; the text around them holds no measured number; the
pre-registered texts in results/preregistered.md are byte for byte those of their freezing commits; every results
row records its commit and the command that remakes it; every verdict recomputes from its JSON's own rows; no file
under results/ is over 600 lines. Run: python -m pytest -q tests/test_report.py"""
import json
import os
import re
import shlex
import subprocess

import pytest

import copy_rule
import decisive
import report
from provenance import result_rows
from test_commands import check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "results")


def read(*path):
    with open(os.path.join(REPO, *path), encoding="utf-8") as f:
        return f.read()


def git(*args):
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def history():
    """Why the git history cannot answer (no git, no .git, or a shallow clone), or None where it can."""
    try:
        r = git("rev-parse", "--is-shallow-repository")
    except OSError:
        return "no git"
    if r.returncode:
        return "no git history (not a git checkout)"
    return "a shallow clone" if r.stdout.strip() == "true" else None


@pytest.mark.parametrize("doc", report.DOCS)
def test_the_write_up_is_what_report_renders(doc):
    """Each block between `<!-- report NAME -->` and `<!-- /report -->` is what results/report.py renders from the
    committed JSON now: a table or verdict typed by hand, or left behind by a rerun, fails here."""
    text = read(doc)
    assert report.BLOCK.search(text), doc
    assert report.render(text) == text, f"{doc}: run python results/report.py"


def test_summary_is_what_report_renders():
    assert report.summary(RESULTS) == read("results", "summary.md"), "run python results/report.py"


def outside_blocks(text):
    """text without its rendered blocks, code spans and link targets: what a person wrote."""
    text = report.BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`|\]\([^)]*\)", "", text)


def test_no_measured_number_is_typed_by_hand():
    """Outside the rendered blocks, results/README.md and README.md's Results section hold no decimal number and no
    percentage: a measured number there would go stale when the JSON changes."""
    readme = read("README.md")
    results = readme[readme.index("## Results\n"):readme.index("\n## ", readme.index("## Results\n") + 1)]
    for name, text in (("results/README.md", read("results", "README.md")), ("README.md's Results", results)):
        typed = re.findall(r"\d\.\d|\d\s?%", outside_blocks(text))
        assert typed == [], f"{name}: {typed}"


def test_the_readme_gives_one_short_bullet_per_claim():
    """README.md's Results: one bullet per claim of results/report.py, at most 400 characters each."""
    block = report.BLOCK.search(read("README.md")).group(3)
    bullets = [" ".join(b.split()) for b in block.split("\n- ")]
    assert len(bullets) == len(report.CLAIMS)
    assert [len(b) for b in bullets if len(b) > 400] == []


def test_the_results_readme_is_short():
    assert len(read("results", "README.md").splitlines()) <= 400


def test_no_results_file_is_over_600_lines():
    """A reader can walk results/: every text file in it, code and data alike, is at most 600 lines."""
    long = []
    for name in sorted(os.listdir(RESULTS)):
        path = os.path.join(RESULTS, name)
        if os.path.isfile(path) and not name.endswith(".png"):
            with open(path, encoding="utf-8") as f:
                if (n := len(f.read().splitlines())) > 600:
                    long.append((name, n))
    assert long == []


def frozen_texts():
    """results/preregistered.md's frozen texts: [(commit, text)]."""
    return re.findall(r"<!-- frozen ([0-9a-f]{7,40}) -->\n(.*?)\n<!-- /frozen -->", read("results", "preregistered.md"),
                      re.S)


def test_the_frozen_texts_are_byte_identical_to_their_commits():
    """Each pre-registered text stands in results/preregistered.md exactly as results/README.md held it at its
    freezing commit, heading and all; renames since are said outside it."""
    texts = frozen_texts()
    assert len(texts) >= 4 and all(text.startswith("### ") for _, text in texts)
    if why := history():
        pytest.skip(f"{why}: the freezing commits cannot be read")
    for commit, text in texts:
        then = git("show", f"{commit}:results/README.md")
        assert then.returncode == 0, then.stderr
        assert text in then.stdout, f"the text frozen at {commit} differs from that commit's"


def committed_json():
    """Every results JSON but gpu_check.json (results/gpu_check.py's, whose stages record their own cmd and commit)."""
    return {name: json.loads(read("results", name)) for name in sorted(os.listdir(RESULTS))
            if name.endswith(".json") and name != "gpu_check.json"}


def records(doc):
    """A JSON's rows, and the retrained runs nested in them."""
    for row in result_rows(doc):
        yield row
        if isinstance(row.get("retrain"), dict):
            yield row["retrain"]


def test_every_committed_row_records_its_commit_and_command():
    """Each row names the commit that first held its numbers and the command that remakes them in a checkout of that
    commit (whose script that commit holds), or a null command and why; each verdict object its commit and command
    in verdict_provenance."""
    scripts = set()
    for name, doc in committed_json().items():
        for r in records(doc):
            assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", r.get("commit", "")), (name, r)
            assert "command" in r, (name, r.get("commit"))
            if r["command"] is None:
                assert r.get("why_no_command"), (name, r["commit"])
            else:
                assert r["command"].startswith("python "), (name, r["command"])
                scripts.add((r["commit"], shlex.split(r["command"])[1]))
    verdicts = dict(lm1024=("copy_verdict", "swap_verdict", "long_verdict"), mqar_decisive=("verdicts", "overall"))
    docs = committed_json()
    for name, keys in verdicts.items():
        assert set(docs[f"{name}.json"]["verdict_provenance"]) == set(keys)
        for key in keys:
            v = docs[f"{name}.json"]["verdict_provenance"][key]
            assert re.fullmatch(r"[0-9a-f]{7,40}", v["commit"]) and v["command"].startswith("python "), (name, key)
            scripts.add((v["commit"], shlex.split(v["command"])[1]))
    if why := history():
        pytest.skip(f"{why}: the commands' commits cannot be read")
    assert [(c, s) for c, s in sorted(scripts) if git("cat-file", "-e", f"{c}:{s}").returncode] == []


def test_coverage_files_name_a_command_that_runs_as_written():
    """coverage.json's and coverage_value.json's command names today's script and settings."""
    for name in ("coverage.json", "coverage_value.json"):
        assert check(json.loads(read("results", name))["command"]) == [], name


def test_every_verdict_recomputes_from_its_rows():
    """The committed verdicts are what the pre-registered rules (copy_rule.py, decisive.py) give on the JSON's rows."""
    plain = lambda x: json.loads(json.dumps(x))  # noqa: E731 (keys as the JSON holds them)
    drop = lambda d: {k: v for k, v in d.items() if k not in ("commit", "command")}  # noqa: E731
    lm1024, mqar = json.loads(read("results", "lm1024.json")), json.loads(read("results", "mqar_decisive.json"))
    setup = lm1024["setup"]
    windows = plain(copy_rule.window_verdicts(lm1024["runs"], setup))
    assert windows == {w: drop(v) for w, v in lm1024["verdicts"].items()}
    assert lm1024["copy_verdict"] == windows[str(setup["window"])]["verdict"]
    assert plain(copy_rule.long_verdict(lm1024["runs"], lm1024["long_runs"], setup)) == lm1024["long_verdict"]
    assert copy_rule.swap_verdict_of(lm1024["swap"], setup["T"]) == lm1024["swap_verdict"]
    assert decisive.verdicts_of(mqar) == (mqar["verdicts"], mqar["overall"])
