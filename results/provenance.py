"""
Where a result comes from, so that no number in results/*.json needs the git log to be trusted. A row that a results
script writes records the commit and the command that first wrote its content. Rows written before rows recorded
their command name the commit that first held their numbers (found with git) and the command that remakes them in a
checkout of that commit (found in its scripts), or a null command and why_no_command (the hand-run probes). A row is
a dict in a JSON's top-level list, or a value of its top-level dict of dicts (copy_paths, predicted, ...).
"""
import functools
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("commit", "command", "why_no_command")


@functools.cache
def provenance():
    """{"commit": HEAD's short hash, with "-dirty" if a tracked .py file differs from it (the code, not the results
    a run writes), or "unknown" outside git; "command": this process's argv as a shell line}; the first call's."""
    git = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    try:
        head, changed = git("rev-parse", "--short", "HEAD"), git("diff", "--quiet", "HEAD", "--", "*.py").returncode
    except OSError:  # no git
        head, changed = None, 0
    commit = head.stdout.strip() + "-dirty" * bool(changed) if head and head.returncode == 0 else "unknown"
    return dict(commit=commit, command=shlex.join(["python", *sys.argv]))


def result_rows(doc):
    """The rows of a results JSON."""
    for v in doc.values():
        if isinstance(v, dict) and all(isinstance(r, dict) for r in v.values()):
            v = list(v.values())
        if isinstance(v, list):
            yield from (r for r in v if isinstance(r, dict))


def stamp(row, known):
    """Gives row (in place, and returns it) the commit and command of the row of known (committed rows) with the same
    content, or else this run's provenance(); a row that has a commit keeps it. So a table rebuilt from the same
    numbers keeps where they came from, and a row with new numbers says it is new."""
    if "commit" in row:
        return row
    content = lambda r: json.dumps({k: v for k, v in r.items() if k not in FIELDS}, sort_keys=True)  # noqa: E731
    same = next((r for r in known if "commit" in r and content(r) == content(row)), None)
    row.update({k: same[k] for k in FIELDS if k in same} if same else provenance())
    return row
