"""
The configurator, after nanoGPT's: a script defines its hyperparameters as plain
globals, then runs (from the repo root, as every command here does)

    exec(open("configurator.py").read())

so that

    python train.py config/quick.py --max_iters=100 --attn=swa

execs each config file and applies each --key=value, left to right. The
hyperparameters are the script's lowercase globals holding an int, float, bool,
str or None. A value must fit its default's type: an int takes an integer, a
float takes 3e-4 or 1, a bool takes True or False, a str takes the raw text
(no quotes needed), and a None default takes any Python literal (else the raw
text). An unknown key, a wrong type or a missing config file stops the script
with a one-line message; --help lists the keys. Afterwards the global `config`
holds every hyperparameter's final value, for logs and checkpoints.
"""
import ast
import builtins  # scripts may shadow builtins with hyperparameters: train.py's `compile`
import os
import sys


def _configure(g, argv):
    types = (int, float, bool, str, type(None))
    keys = {k: v for k, v in g.items() if k[:1].islower() and isinstance(v, types)}
    verbose = os.environ.get("RANK", "0") == "0"  # under torchrun, print once

    def check(key, value, where):
        """value, made to fit key's default type, or SystemExit."""
        if key not in keys:
            close = [k for k in keys if k.split("_")[0] == key.split("_")[0]] or sorted(keys)
            sys.exit(f"{where}: unknown config key {key!r}; known keys include: {', '.join(close)}")
        default = keys[key]
        if default is None or type(value) is type(default):
            return value
        if isinstance(default, float) and type(value) is int:
            return float(value)
        sys.exit(f"{where}: {key} must be of type {type(default).__name__} (like {default!r}), got {value!r}")

    for arg in argv:
        if arg in ("-h", "--help"):
            print("\n".join(f"--{k}={v!r}" for k, v in keys.items()))
            sys.exit(0)
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                sys.exit(f"{arg}: expected --key=value")
            if isinstance(keys.get(key), str):
                value = text
            else:
                try:
                    value = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    value = text  # a bare word: a string, which check() accepts only where a str or None fits
            g[key] = keys[key] = check(key, value, arg)
            if verbose:
                print(f"overriding: {key} = {g[key]!r}", file=sys.stderr)
        elif arg.endswith(".py"):
            if not os.path.isfile(arg):
                sys.exit(f"config file {arg} not found (presets live in config/)")
            ns = {}
            try:
                exec(builtins.compile(open(arg).read(), arg, "exec"), ns)
            except SyntaxError as e:
                sys.exit(f"{arg}:{e.lineno}: syntax error: {e.msg}")
            if verbose:
                print(f"config file: {arg}", file=sys.stderr)
            for key, value in ns.items():
                if not key.startswith("_") and isinstance(value, types):
                    g[key] = keys[key] = check(key, value, arg)
        else:
            sys.exit(f"unexpected argument {arg!r}: use --key=value or a config file path ending in .py")
    return dict(keys)


config = _configure(globals(), sys.argv[1:])
del _configure
