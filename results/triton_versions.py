"""
kernel.py under every Triton minor from 3.0 to 3.9: the Triton a user actually has, since a CUDA
build of torch brings its own (torch 2.4 brings 3.0, torch 2.11 brings 3.6). Writes
results/kernel_triton_versions.txt, one line per version: PASS, or FAIL with the reason.

    python results/triton_versions.py                      # 3.0 ... 3.9: 10 minutes on 2 CPU cores, a fast pip index
    python results/triton_versions.py --versions=3.0,3.6   # some (their lines replace the old ones)

For each version: a temporary venv (--system-site-packages, so the system's torch is used) with
`pip install triton==3.X.*` in it (about 300 MB; set PIP_FIND_LINKS to a folder of downloaded
wheels to install offline), then
  (a) tests/test_kernel.py's fp32 tests in Triton's CPU interpreter (TRITON_INTERPRET=1), and
  (b) ahead-of-time compiles for sm_80 and sm_90 with the wheel's bundled ptxas (no GPU): bf16,
      D = 64 and 128, forward and backward as launched for SA's rank and value rules, and _rowdot,
      with choose_tiling's tiles;
and the venv is deleted before the next. Not a CI test: each Triton is a large download.
"""
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# -----------------------------------------------------------------------------
versions = "3.0,3.1,3.2,3.3,3.4,3.5,3.6,3.7,3.8,3.9"  # Triton minors to test, comma separated
tests = ("fp32 or head_dim_64 or default_tiling or through_triton and not dtype4 or huge_scores and dtype0 "
         "or one_short_of_a_key_tile or edge_of_delta or nan_key or bad_value")  # pytest -k: fp32 kernel output tests
pip_extra = ""          # more requirements per venv, e.g. "numpy<2.4" (3.2-3.6's interpreter), "numpy<2" (3.0, 3.1)
compile = True          # also run (b); False: only (a), e.g. to rerun the interpreter with pip_extra
timeout = 1800          # seconds for each stage (install, tests, compiles) of one version
out = os.path.join(ROOT, "results", "kernel_triton_versions.txt")
logs = ""               # also keep each stage's full output in this folder
aot = False             # internal: run the compiles (b) in this process, with the Triton it imports
# -----------------------------------------------------------------------------
exec(open(os.path.join(ROOT, "configurator.py")).read())

SHARED_KB = {80: 163, 90: 227}  # shared memory a program may opt into on sm_80 (A100) and sm_90 (H100)
KERNELS = ("forward sa", "backward sa", "forward value", "backward value", "rowdot sa")  # compiled for each and D


def ast_source(fn, dtype, consts):
    """triton.compiler.ASTSource for fn with these constexprs, its pointers and strides multiples of 16 (as
    Triton's launcher marks them), in the format of the Triton imported: it changed at 3.2 (the backend's
    AttrsDescriptor) and at 3.3 (constexprs in the signature, attributes keyed by index tuples)."""
    from triton.compiler import ASTSource
    names = fn.arg_names
    sig = {n: f"*{dtype}" if n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV") else "*fp32" if n in ("LSE", "RowDot")
           else "*fp32" if n == "R" else "*i64" if n == "Perm" else "*i32" if n == "Spans"
           else "fp32" if n.endswith("scale") or n in ("width", "margin") else "i32" for n in names if n not in consts}
    aligned = [i for i, n in enumerate(names)  # pointers and strides
               if sig.get(n, "")[:1] == "*" or n[:3] in ("sq_", "sk_", "sv_", "so_", "sp_")]
    if "constexprs" in inspect.signature(ASTSource).parameters:  # 3.3 on
        return ASTSource(fn, {n: sig.get(n, "constexpr") for n in names}, consts, {(i,): [["tt.divisibility", 16]]
                                                                                  for i in aligned})
    try:                                                          # 3.2
        from triton.backends.compiler import AttrsDescriptor
        attrs = AttrsDescriptor.from_hints({i: 16 for i in aligned})
    except ImportError:                                           # 3.0, 3.1
        from triton.compiler.compiler import AttrsDescriptor
        attrs = AttrsDescriptor(divisible_by_16=set(aligned))
    return ASTSource(fn, sig, consts, attrs)


def compile_all():
    """(b), in this process: one line per kernel with its shared memory; raises at the first failure."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    import kernel
    for arch, D, which in [(a, D, w) for a in SHARED_KB for D in (64, 128) for w in KERNELS]:
        tiling = kernel.choose_tiling(torch.bfloat16, D, kernel.Target("cuda", arch, SHARED_KB[arch] * 1024))
        if which.startswith("forward"):
            fn, consts = kernel._attn_fwd, dict(D=D, TILE_M=tiling.tile_m, TILE_N=tiling.tile_n)
        elif which.startswith("backward"):
            fn, consts = kernel._attn_bwd, dict(D=D, TILE_FIXED=tiling.tile_fixed, TILE_LOOP=tiling.tile_loop,
                                                DQ_ATOMIC=False)
        else:
            fn, consts = kernel._rowdot, dict(D=D, TILE=tiling.tile_fixed)
        consts.update(HAS_PERM=True)  # as SA launches them: perm, and r for the value rule
        if fn is not kernel._rowdot:  # today's tiling: no variant (kernel.Tiling's switches) on
            consts.update(HAS_R=which.endswith("value"), PRECISION=tiling.precision, ONE_LOOP=False, SPANS_FIRST=False)
        compiled = triton.compile(ast_source(fn, "bf16", consts), target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=tiling.num_warps, num_stages=tiling.num_stages))
        print(f"sm_{arch} bf16 D={D} {which}: {compiled.metadata.shared / 1024:.1f} KB shared", flush=True)


def run(cmd, **env):
    """(ok, output) of a command in ROOT, with a time limit."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout} s"
    return p.returncode == 0, p.stdout + p.stderr


def reason(output):
    """The line of a failure's output that says why: the last exception or pytest error line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    why = [line for line in lines if line.startswith("E ") or "Error:" in line or "error:" in line]
    return (why or lines or ["no output"])[-1].removeprefix("E").strip()[:200]


def check(version):
    """One result line for Triton `version` ("3.X"): PASS if both (a) and (b) pass, else what failed."""
    venv = tempfile.mkdtemp(prefix=f"triton{version}-")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        ok, log = run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"triton=={version}.*",
                       *(pip_extra.split(",") if pip_extra else [])])
        if not ok:
            return f"{version}{f' ({pip_extra})' * bool(pip_extra)} FAIL  pip install: {reason(log)}"
        got = run([py, "-c", "import triton; print(triton.__version__)"])[1].strip().splitlines()[-1]
        got += f" ({pip_extra})" * bool(pip_extra)
        ok_a, log = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernel.py", "-k", tests],
                        TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        save_log(got, "interpreter", log)
        summary = re.sub(r" in [\d.]+s.*", "", (log.strip().splitlines() or ["no output"])[-1].strip("= "))
        a = f"interpreter fp32 tests: {summary}" + ("" if ok_a else f" ({reason(log)})")
        if not compile:
            return f"{got:<7} {'PASS' if ok_a else 'FAIL'}  {a}; compile not run"
        with tempfile.TemporaryDirectory() as cache:  # a fresh cache, so that ptxas really runs
            ok_b, log = run([py, os.path.abspath(__file__), "--aot=True"], TRITON_CACHE_DIR=cache,
                            TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
        save_log(got, "compile", log)
        compiled = [line for line in log.splitlines() if line.startswith("sm_")]
        b = (f"sm_80+sm_90 bf16 D=64,128 sa+value fwd+bwd, rowdot compile: {len(compiled)} of {len(KERNELS) * 4}" + (
            f" (at most {max(float(c.split(': ')[1].split()[0]) for c in compiled):.1f} KB shared)" if ok_b
            else f", then {reason(log)}"))
        return f"{got:<7} {'PASS' if ok_a and ok_b else 'FAIL'}  {a}; {b}"
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def save_log(version, stage, log):
    if logs:
        os.makedirs(logs, exist_ok=True)
        with open(os.path.join(logs, f"triton{version}-{stage}.log"), "w") as f:
            f.write(log)


if __name__ == "__main__":
    if aot:
        compile_all()
        sys.exit()
    import numpy
    import torch
    which = lambda line: re.split(r" +(?:PASS|FAIL) ", line)[0]  # the version (and pip_extra)
    lines = {}
    if os.path.exists(out):
        lines = {which(line): line for line in open(out).read().splitlines() if line.strip() and line[0] != "#"}
    for version in versions.split(","):
        line = check(version)
        lines[which(line)] = line
        print(line, flush=True)
        with open(out, "w") as f:  # after each version, so that a long run keeps what it measured
            f.write(f"# python results/triton_versions.py   (torch {torch.__version__}, numpy {numpy.__version__}, "
                    f"python {sys.version.split()[0]}; no GPU: interpreter tests and ahead-of-time compiles only)\n")
            f.write("\n".join(sorted(lines.values(), key=lambda line: (int(line.split(".")[1]), line))) + "\n")
