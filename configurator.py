"""
Support, which a first reading skips. nanoGPT's configurator: a script runs `exec(open("configurator.py").read())`
after its plain globals, which each config file and --key=value then override, left to right, printing what it sets:
    python train.py config/quick.py --attn=swa
A value must fit its default's type (a None default: its annotation's) and range (guards.SETTINGS), else the script
ends in one line, as on any InputError, a config file's error or Ctrl-C; other exceptions keep their traceback.
`settings` then holds every setting, for logs and checkpoints; --help lists them.
"""
import ast
import builtins
import os
import sys
import traceback
import typing

from guards import InputError, one_line, setting_problem


def _configure(g, argv):
    keys = {k: v for k, v in g.items() if k[:1].islower() and isinstance(v, (int, float, bool, str, type(None)))}
    hints = g.get("__annotations__", {})

    def setting(key, value, where):
        if key not in keys:
            raise InputError(f"{where}: unknown setting {key!r}; --help lists them")
        want = typing.get_args(hints[key])[0] if key in hints else type(keys[key])
        value = float(value) if want is float and type(value) is int else value
        if not (type(value) is want or value is None and key in hints):
            raise InputError(f"{where}: {key} must be of type {want.__name__}{' or None' * (key in hints)} (like "
                             f"{keys[key]!r}), got {value!r}")
        g[key] = keys[key] = value
        if os.environ.get("RANK", "0") == "0":  # under torchrun, once
            print(f"{'overriding' if where[:2] == '--' else where}: {key} = {value!r}", file=sys.stderr)

    for arg in argv:
        key, eq, text = arg.removeprefix("--").partition("=")
        if arg in ("-h", "--help"):
            print("\n".join(f"--{k}={v!r}" for k, v in keys.items()))
            sys.exit(0)
        elif arg.startswith("--") and eq:
            try:
                value = text if isinstance(keys.get(key), str) else ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word: a str
            setting(key, value, arg)
        elif arg.endswith(".py"):
            ns = {}
            try:
                with open(arg, encoding="utf-8-sig") as f:
                    exec(builtins.compile(f.read(), arg, "exec"), ns)  # train.py's `compile` is a setting
            except Exception as e:  # the file's own fault, at its line
                line = e.lineno if isinstance(e, SyntaxError) else next((t.lineno for t in traceback.extract_tb(
                    e.__traceback__)[::-1] if t.filename == arg), None)
                raise InputError(f"{arg}{f':{line}' if line else ''}: {type(e).__name__}: {e}") from None
            for key, value in ns.items():  # settings are lower case: `N = 2` is the file's own helper
                if key[:1].islower() and (key in keys or not callable(value) and type(value).__name__ != "module"):
                    setting(key, value, arg)
        else:
            raise InputError(f"unexpected argument {arg!r}: use --key=value or a config file ending in .py")
    for key, value in keys.items():  # every final value, the script's own edits too
        if problem := setting_problem(key, value, keys):
            raise InputError(f"{key}={value!r}: {problem}")
    return dict(keys)


if globals().get("__name__") == "__main__":  # a script, not a test that runs this on a dict
    sys.excepthook = one_line
settings = _configure(globals(), sys.argv[1:])
del _configure
