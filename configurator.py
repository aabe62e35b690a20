"""
The configurator, after nanoGPT's. A script defines its hyperparameters as plain globals, then runs
`exec(open("configurator.py").read())`, so that

    python train.py config/quick.py --max_iters=100 --attn=swa

execs each config file and applies each --key=value, left to right, printing every key it sets. A value must
fit its default's type (an int takes an integer within 64 bits, a float 3e-4 or 1, a bool True or False, a str
the raw text; a None default takes its annotation's type or any literal), and a float must be finite. Anything
else stops the script with one line, so that a typo never trains with a default silently. --help lists the keys.
Afterwards the global `config` holds every hyperparameter's final value, for logs and checkpoints, and
`check_setting(key, ok, rule)` is the scripts' one range check: a ValueError naming the key and its value.

A script that runs this also gets one line, not a traceback, for what its user can fix: a ValueError raised by
this repo's code (a setting, an input, a file; library code raises nothing else for those), exit status 1, and
Ctrl-C (the shell's 130). Any other exception is a bug, and keeps its traceback.
"""
import ast
import builtins  # scripts may shadow builtins with hyperparameters: train.py's `compile`
import math
import os
import sys
import traceback
import typing


def _configure(g, argv):
    types = (int, float, bool, str, type(None))
    keys = {k: v for k, v in g.items() if k[:1].islower() and isinstance(v, types)}
    hints = g.get("__annotations__", {})  # the type of a None default: `key: int | None = None`
    verbose = os.environ.get("RANK", "0") == "0"  # under torchrun, print once

    def check(key, value, where, bare=False):
        """value, made to fit key's default type, or SystemExit. bare: value is text that is no literal."""
        if key not in keys:
            close = [k for k in keys if k.split("_")[0] == key.split("_")[0]] or sorted(keys)
            sys.exit(f"{where}: unknown config key {key!r}; known keys include: {', '.join(close)}")
        default = keys[key]
        if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf: no setting means that
            sys.exit(f"{where}: {key} must be a finite number, got {value}")
        if type(value) is int and not -2**63 <= value < 2**63:  # torch and numpy take 64-bit integers
            sys.exit(f"{where}: {key} must fit in 64 bits (|{key}| < 2**63), got {value}")
        if key in hints:  # a None default's declared type, else the default's own
            want = [t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None)][0]
        elif default is None:  # unannotated: any literal, but not a bare word
            if bare:
                sys.exit(f"{where}: {key} takes a Python literal (None, 3, 'text'), got the bare word {value!r}")
            return value
        else:
            want = type(default)
        nullable = type(None) in typing.get_args(hints.get(key))
        if value is None and nullable or type(value) is want:
            return value
        if want is float and type(value) is int:
            return float(value)
        sys.exit(f"{where}: {key} must be of type {want.__name__}" + (" or None" if nullable else "")
                 + f" (like {default!r}), got {value!r}")

    for arg in argv:
        if arg in ("-h", "--help"):
            print("\n".join(f"--{k}={v!r}" for k, v in keys.items()))
            sys.exit(0)
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                sys.exit(f"{arg}: expected --key=value")
            value, bare = text, not isinstance(keys.get(key), str)
            if bare:
                try:
                    value, bare = ast.literal_eval(text), False
                except (ValueError, SyntaxError):
                    pass  # a bare word: text, which check() accepts only where a str fits
            g[key] = keys[key] = check(key, value, arg, bare)
            if verbose:
                print(f"overriding: {key} = {g[key]!r}", file=sys.stderr)
        elif arg.endswith(".py"):
            if not os.path.isfile(arg):
                sys.exit(f"config file {arg} not found (presets live in config/)")
            ns = {}
            try:
                with open(arg, encoding="utf-8") as f:
                    exec(builtins.compile(f.read(), arg, "exec"), ns)
            except SyntaxError as e:
                sys.exit(f"{arg}:{e.lineno}: syntax error: {e.msg}")
            except UnicodeDecodeError:
                sys.exit(f"{arg}: not UTF-8 text")
            except Exception as e:  # the config file's own code failed: its line, not this file's traceback
                line = [t.lineno for t in traceback.extract_tb(e.__traceback__) if t.filename == arg][-1:]
                sys.exit(f"{arg}:{''.join(map(str, line))}: {type(e).__name__}: {e}")
            for key, value in ns.items():
                if isinstance(value, (list, tuple, dict, set)) and key[:1].islower():  # no setting takes one
                    sys.exit(f"{arg}: the setting {key} takes a number, a bool, a str or None, not {value!r}")
                if not key.startswith("_") and isinstance(value, types):
                    g[key] = keys[key] = check(key, value, arg)
                    if verbose:  # a global edited in the script and set again here: this line says which wins
                        print(f"{arg}: {key} = {g[key]!r}", file=sys.stderr)
        else:
            sys.exit(f"unexpected argument {arg!r}: use --key=value or a config file path ending in .py")
    return dict(keys)


def _one_line(kind, error, tb):
    """sys.excepthook of a script: a ValueError raised in this repo's files, or Ctrl-C, as one line."""
    root = os.path.dirname(os.path.abspath(sys.argv[0]))
    root = root if os.path.isfile(os.path.join(root, "configurator.py")) else os.path.dirname(root)  # results/
    last = tb
    while last is not None and last.tb_next is not None:  # the frame that raised it
        last = last.tb_next
    where = last and last.tb_frame.f_globals.get("__file__", last.tb_frame.f_code.co_filename)  # check_setting: script
    ours = last is not None and os.path.abspath(where).startswith(root + os.sep)
    if issubclass(kind, KeyboardInterrupt) or (issubclass(kind, ValueError) and ours):
        print(str(error) or "interrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, error, tb)


def check_setting(key, ok, rule):
    """A one-line ValueError naming key and its value (in config) unless ok."""
    if not ok:
        raise ValueError(f"{key}={config[key]!r}: {rule}")


config = _configure(globals(), sys.argv[1:])
if globals().get("__name__") == "__main__":  # a script, not a test that runs this on a dict
    sys.excepthook = _one_line
del _configure
