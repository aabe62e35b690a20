"""Every `python ...` command that README.md, results/README.md and the scripts' docstrings give a reader names real
files and real settings: its script exists, each --key=value is a global of that script (configurator.py's settings)
of a fitting type, each config file exists and sets only that script's settings, and a `python -c` imports what it can
from the repo root. Cheap and offline: nothing here trains or downloads. Run: python -m pytest -q tests/test_commands.py"""
import ast
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, fields

import pytest

import model
from guards import setting_problem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "results/README.md"]
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "results", "*.py")))
ANY = object()  # a setting whose default is no literal (e.g. "cuda" if ... else "cpu"): any value fits


def docstrings(path):
    tree = ast.parse(open(path).read())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return [d for d in map(ast.get_docstring, nodes) if d]


def commands(text):
    """The `python ...` and `torchrun ...` commands of a text: code lines and inline `code` spans, continuation
    lines joined, `&&` chains split, leading VAR=value assignments and trailing comments dropped."""
    text = text.replace("\\\n", " ")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # inline spans outside the fences
    found = text.splitlines() + [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    out = []
    for line in found:
        for part in line.split("&&"):
            part = part.split(" # ")[0].strip().lstrip("$ ")
            part = re.sub(r"^(\w+=\S+ )+", "", part).replace("[", "").replace("]", "")  # [--optional=settings]
            if re.match(r"(python|torchrun) \S", part):
                out.append(part)
    return out


def every_command():
    cmds = {}
    for doc in DOCS:
        for c in commands(open(os.path.join(REPO, doc)).read()):
            cmds.setdefault(c, doc)
    for path in SCRIPTS:
        for d in docstrings(path):
            for c in commands(d):
                cmds.setdefault(c, os.path.relpath(path, REPO))
    return sorted(cmds.items())


def script_settings(path):
    """configurator.py's settings of a script: its module-level lowercase globals, with their literal defaults."""
    defaults = {}
    for node in ast.parse(open(path).read()).body:
        statement = ast.unparse(node)
        if statement.startswith("globals().update({f.name: f.default for f in fields(GPTConfig)"):  # train.py
            defaults.update({k: v for k, v in asdict(model.GPTConfig()).items() if k not in defaults})
        if statement.startswith("for _field in fields(GPTConfig):"):  # eval.py, sample.py: a new kind's, None
            defaults.update({f.name: None for f in fields(model.GPTConfig)
                             if f.name not in defaults and f.name not in model.BUILT})
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                pairs += list(zip(target.elts, value.elts))
            elif isinstance(target, ast.Name) and target.id[:1].islower():
                try:
                    defaults[target.id] = ast.literal_eval(value)
                except ValueError:
                    defaults[target.id] = ANY
    return defaults


def fits(default, text):
    """Whether --key=text fits default's type as configurator.py reads it (a literal, else the raw text)."""
    if default is ANY or default is None or isinstance(default, str):
        return True
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return type(value) is type(default)


def check(command):
    """The problems of one command: [] when it names real files and settings."""
    words = shlex.split(re.sub(r"<[^<>]*>", "<...>", command))  # a placeholder such as <the six> fits any setting
    if words[0] == "torchrun":  # torchrun's own options come before the script
        words = ["python"] + [w for w in words[1:] if not w.startswith("--") or w.endswith(".py")][:1] + \
            words[1 + next(i for i, w in enumerate(words[1:]) if w.endswith(".py")) + 1:]
    if words[1] == "-c":  # its imports, run from the repo root as the reader would
        imports = [ast.unparse(n) for n in ast.walk(ast.parse(words[2])) if isinstance(n, (ast.Import, ast.ImportFrom))]
        r = subprocess.run([sys.executable, "-c", "; ".join(imports)], cwd=REPO, capture_output=True, text=True)
        return [f"cannot {'; '.join(imports)} from the repo root"] if r.returncode else []
    if words[1] == "-m":
        return [f"no file {w}" for w in words[3:] if w.endswith(".py") and not os.path.exists(os.path.join(REPO, w))]
    script = os.path.join(REPO, words[1])
    if not os.path.isfile(script):
        return [f"no script {words[1]}"]
    defaults, problems = script_settings(script), []
    if words[1] == "kernel.py":  # a leaf file: its own flags (kernel.py --check's usage line), no configurator
        defaults = dict(check="", B=1, H=1, D=1, check_T="", check_windows="")
    values = {k: v for k, v in defaults.items() if v is not ANY}  # the final settings, as far as literals tell
    for arg in words[2:]:
        if arg in ("...", "-h", "--help"):
            continue
        if arg.endswith(".py"):
            if not os.path.isfile(os.path.join(REPO, arg)):
                problems.append(f"no config file {arg}")
            else:
                ns = script_settings(os.path.join(REPO, arg))
                problems += [f"{arg} sets {k}, not a setting of {words[1]}" for k in ns if k not in defaults]
                values.update({k: v for k, v in ns.items() if v is not ANY})
            continue
        name, eq, value = arg[2:].partition("=")
        if words[1] == "kernel.py" and arg == "--check":
            continue
        if not arg.startswith("--") or not eq:
            problems.append(f"{arg!r} is no --key=value")
        elif name not in defaults:
            problems.append(f"--{name} is not a setting of {words[1]}")
        elif value != "<...>" and not fits(defaults[name], value):
            problems.append(f"--{name}={value} does not fit its default {defaults[name]!r}")
        elif value != "<...>" and defaults[name] is not ANY and not isinstance(defaults[name], str):
            try:
                values[name] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                values[name] = value  # a bare word: a str, as configurator.py reads it
        else:
            values.pop(name, None)
    numbers = {k: v for k, v in values.items() if type(v) in (int, float)}  # their ranges (guards.CHECKS)
    return problems + [f"{k}={v!r}: {p}" for k, v in numbers.items() if (p := setting_problem(k, v, values))]


COMMANDS = every_command()


def test_the_docs_give_commands():
    """The scan finds the commands it checks: the README's two set-up lines among them."""
    found = [c for c, _ in COMMANDS]
    assert len(found) > 40 and "python train.py config/quick.py" in found and "python -m pytest -q -n 2" in found


@pytest.mark.parametrize("command,where", COMMANDS, ids=[c[:60] for c, _ in COMMANDS])
def test_every_documented_command_names_real_files_and_settings(command, where):
    assert check(command) == [], f"{where}: {command}"


def test_the_check_catches_what_it_should():
    """Each kind of problem the scan must catch, caught: a test that cannot fail would be no test."""
    assert check("python results/bench.py --sizes=4096") == []
    assert check("python bench.py --sizes=4096") == ["no script bench.py"]
    assert check('python -c "import bench; bench.benchmark_generation()"') == ["cannot import bench from the repo root"]
    assert check('python -c "import model; model.GPT"') == []
    assert check("python train.py --widow=3") == ["--widow is not a setting of train.py"]
    assert check("python train.py --max_iters=1.5") == ["--max_iters=1.5 does not fit its default 5000"]
    assert check("python train.py --learning_rate=3e-5") == ["min_lr=6e-05: use a value from 0 to learning_rate"]
    assert check("python train.py config/nope.py") == ["no config file config/nope.py"]
    assert check("python train.py --max_iters=<many>") == [] and check("python train.py --iters=<many>") == [
        "--iters is not a setting of train.py"]
    assert check("python -m pytest -q tests/test_nope.py") == ["no file tests/test_nope.py"]
    assert check("torchrun --standalone --nproc_per_node=8 train.py config/paper_360m.py --attn=swa") == []


def test_the_readme_fits_an_evening():
    """README.md stays short: at most 250 lines, none over 120 characters (the repo's line length)."""
    lines = open(os.path.join(REPO, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= 250
    assert [i for i, line in enumerate(lines, 1) if len(line) > 120] == []


READING = ("model.py", "attention.py", "train.py", "sample.py", "configurator.py")  # README's "Read first"


def test_the_files_a_student_reads_have_short_lines():
    """No line over 120 characters and at most 5% over 100 in the files a first reading goes through (nanoGPT's four:
    3.9% over 100), so that none is cramped."""
    for name in READING:
        lines = open(os.path.join(REPO, name), encoding="utf-8").read().splitlines()
        assert [i for i, line in enumerate(lines, 1) if len(line) > 120] == [], name
        assert sum(len(line) > 100 for line in lines) <= 0.05 * len(lines), name
