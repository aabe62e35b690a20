"""
Support, which a first reading skips. nanoGPT's configurator: a script runs
`exec(open("configurator.py").read())` after its plain globals, which each config file and
--key=value then override, left to right, printing what it sets:
    python train.py config/quick.py --attn=swa
A value must fit its type (where the script annotates the setting, as `window: int | None = None`,
the annotation's first type or None; else its default's type) and its range (guards.CHECKS); if
not, the script ends in one line (guards.one_line), as on any InputError, a config file's error or
Ctrl-C. `setting_names` then names every setting; --help lists them.
"""
import ast
import builtins
import os
import sys
import traceback
import typing

from guards import InputError, need, one_line, setting_problem


def _configure(g, argv):
    plain = (int, float, bool, str, type(None))
    settings = {k: v for k, v in g.items() if k[:1].islower() and isinstance(v, plain)}
    hints = g.get("__annotations__", {})

    def setting(name, value, where):
        need(name in settings, f"{where}: unknown setting {name!r}; --help lists them")
        want = typing.get_args(hints[name])[0] if name in hints else type(settings[name])
        value = float(value) if want is float and type(value) is int else value
        or_none = " or None" if name in hints else ""
        need(type(value) is want or value is None and name in hints,
             f"{where}: {name} must be of type {want.__name__}{or_none} (like {settings[name]!r}), "
             f"got {value!r}")
        g[name] = settings[name] = value
        if os.environ.get("RANK", "0") == "0":  # under torchrun, once
            source = "overriding" if where[:2] == "--" else where
            print(f"{source}: {name} = {value!r}", file=sys.stderr)

    for arg in argv:
        name, eq, text = arg.removeprefix("--").partition("=")
        if arg in ("-h", "--help"):
            print("\n".join(f"--{k}={v!r}" for k, v in settings.items()))
            sys.exit(0)
        elif arg.startswith("--") and eq:
            try:
                value = text if isinstance(settings.get(name), str) else ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word: a str
            setting(name, value, arg)
        elif arg.endswith(".py"):
            ns = {}
            try:
                with open(arg, encoding="utf-8-sig") as f:
                    exec(builtins.compile(f.read(), arg, "exec"), ns)  # train.py's `compile` is a setting
            except Exception as e:  # the file's own fault, at its line
                if isinstance(e, SyntaxError):
                    line = e.lineno
                else:
                    lines = [t.lineno for t in traceback.extract_tb(e.__traceback__) if t.filename == arg]
                    line = lines[-1] if lines else None
                where = f"{arg}:{line}" if line else arg
                raise InputError(f"{where}: {type(e).__name__}: {e}") from None
            for k, value in ns.items():  # settings are lower case: `N = 2` is the file's own helper
                helper = callable(value) or type(value).__name__ == "module"
                if k[:1].islower() and (k in settings or not helper):
                    setting(k, value, arg)
        else:
            raise InputError(f"unexpected argument {arg!r}: use --key=value or a config file (.py)")
    for name, value in settings.items():  # every final value, the script's own edits too
        problem = setting_problem(name, value, settings)
        need(not problem, f"{name}={value!r}: {problem}")
    return list(settings)


if globals().get("__name__") == "__main__":  # a script, not a test that runs this on a dict
    sys.excepthook = one_line
setting_names = _configure(globals(), sys.argv[1:])
del _configure
