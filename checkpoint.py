"""
Support, which a first reading skips. A run's files, written so that nothing is lost and read so that nothing
surprises: ckpt.pt, written atomically (save_checkpoint) and loaded without executing code (weights_only=True), its
zip checked byte for byte and each entry against CHECKPOINT (load_checkpoint); a train.py run's out_dir (RunDir: the
lock, log.jsonl, --overwrite, Ctrl-C); and every RNG state of every rank, so that a resume is exact (rng_states).
"""
import fcntl
import json
import os
import random
import shlex
import signal
import sys
import zipfile

import numpy as np
import torch

from guards import InputError, check_schema, count, device_problem, memory, need, schema_problem
from model import GPT, GPTConfig
from prepare_data import META

RNG_BYTES = torch.get_rng_state().numel()  # a CPU generator's state: torch's, the sampler's and SA's (sa_state)
SCALER = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
          "_growth_tracker": int}  # GradScaler.state_dict() with fp16


def _words(x, n):
    return isinstance(x, (list, tuple)) and len(x) == n and all(type(w) is int and 0 <= w < 2**32 for w in x)


def _generator(x, _):
    return torch.is_tensor(x) and x.dtype == torch.uint8 and x.shape == (RNG_BYTES,)


RNG = {  # one rank's states, as rng_states writes them: {entry: (test, what it must be)}
    **dict.fromkeys(("torch", "sampler", "sa"), (_generator, f"a uint8 tensor of shape ({RNG_BYTES},)")),
    "cuda": (lambda x, _: torch.is_tensor(x) and x.dtype == torch.uint8 and x.dim() == 1, "a uint8 tensor"),
    "numpy": (lambda x, _: isinstance(x, (tuple, list)) and len(x) == 5 and x[0] == "MT19937" and _words(x[1], 624)
              and type(x[2]) is int and 0 <= x[2] <= 624 and x[3] in (0, 1) and isinstance(x[4], float),
              "numpy's ('MT19937', 624 words, position, has_gauss, gauss)"),
    "python": (lambda x, _: isinstance(x, tuple) and len(x) == 3 and x[0] == 3 and _words(x[1], 625)
               and (x[2] is None or isinstance(x[2], float)), "random.getstate()'s (3, 625 words, gauss)"),
}
CHECKPOINT = {  # what train.py writes into ckpt.pt
    "model_args": (lambda x, _: isinstance(x, dict) and "attn" in x and not x.keys() - GPTConfig.__dataclass_fields__.keys(),
                   "GPTConfig's fields"),  # GPTConfig checks their values
    "model": (lambda x, _: isinstance(x, dict) and all(map(torch.is_tensor, x.values())), "a state_dict (tensors)"),
    "iter_num": (lambda x, _: count(x), "an integer >= 0"),
    "best_val_loss": (lambda x, _: isinstance(x, float) and x >= 0, "a loss (a float >= 0, inf at first)"),
    "settings": (lambda x, _: isinstance(x, dict), "a dict"),
    "optimizer": (lambda x, _: isinstance(x, dict) and isinstance(x.get("state"), dict)
                  and isinstance(x.get("param_groups"), list), "an optimizer's state_dict"),
    "scaler": (lambda x, _: isinstance(x, dict) and (not x or x.keys() == SCALER.keys() and all(
        type(x[k]) is t and x[k] >= 0 for k, t in SCALER.items())), "a GradScaler's state_dict ({} but with fp16)"),
    "meta": (lambda x, _: (p := schema_problem(x, META, ("vocab_size", "tokenizer"))) and f"fails: {p}" or True,
             "a dataset's meta.json"),
    "rng": (lambda x, _: isinstance(x, list) and len(x) > 0 and next((f"fails for rank {i}: {p}" for i, s in enumerate(x)
                                                                      if (p := schema_problem(s, RNG, (
                                                                          "torch", "numpy", "python", "sampler",
                                                                          "sa")))), True),
            "a list of each rank's RNG states"),
}


def save_checkpoint(obj, path):
    """torch.save to a temporary file, then os.replace: a crash mid-write leaves the old checkpoint whole."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, device="cpu", require=(), resume=None):
    """(model, ckpt) from a train.py checkpoint, loaded onto the CPU (where the RNG states it holds must stay), the model
    then moved to device. require: the entries the caller reads besides model and model_args; resume: train.py's
    (settings, meta), which must be the checkpoint's (check_resume). A missing, damaged or foreign file, an entry
    missing or not as train.py writes it, weights that do not fit model_args or that hold NaN: one InputError line."""
    if resume is not None:
        require = ("optimizer", "iter_num", "best_val_loss", "settings", "meta", "rng")
    need(os.path.isfile(path), f"checkpoint {path} not found: train one with train.py, which writes out_dir/ckpt.pt")
    need(device_problem(str(device)) is None, f"device={device!r}: {device_problem(str(device))}")
    try:
        with zipfile.ZipFile(path) as z:  # torch.load skips the zip's CRCs: a flipped byte would load
            damaged = z.testzip()
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zips, random bytes and pickles of arbitrary classes all land here
        raise InputError(f"checkpoint {path} is unreadable ({type(e).__name__}): it is corrupt, truncated, or holds "
                         "more than tensors and plain Python values; restore it or train again") from None
    need(damaged is None, f"checkpoint {path} is damaged: its entry {damaged} fails its checksum; restore it or train "
         "again")
    check_schema(ckpt, CHECKPOINT, path, required=("model", "model_args", *require))
    try:
        with torch.device("meta"):  # shapes only: model_args that do not fit the weights allocate nothing
            shapes = GPT(GPTConfig(**ckpt["model_args"]))
    except InputError as e:
        raise InputError(f"{path} has an incompatible config: {e}") from None
    expected, saved = shapes.state_dict(), ckpt["model"]
    mismatched = sorted(expected.keys() ^ saved.keys()) + sorted(
        k for k in expected.keys() & saved.keys() if (expected[k].shape, expected[k].dtype) != (saved[k].shape,
                                                                                                saved[k].dtype))
    need(not mismatched, f"{path}: its weights do not fit its model_args ({len(mismatched)} mismatched entries, e.g. "
         f"{mismatched[:3]}): the file was edited or written by other code")
    need_bytes = sum(t.numel() * t.element_size() for t in [*shapes.parameters(), *shapes.buffers()])  # RoPE's too
    need(need_bytes <= memory("cpu"), f"{path}: its model_args make a model of {need_bytes / 2**30:,.0f} GiB, more than "
         "this machine's memory: the file was edited or written by other code")
    nan = [k for k, v in saved.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    need(not nan, f"{path}: {len(nan)} weights hold NaN or inf (e.g. {nan and nan[0]}): the run that wrote it "
         "diverged; train again with a lower learning_rate")
    if resume is not None:
        check_resume(path, ckpt, *resume)
    model = GPT(shapes.config)
    model.load_state_dict(saved)
    return model.to(device), ckpt


def check_resume(path, ckpt, settings, meta):
    """A resume's checkpoint must be of this run: data of the same vocabulary, the same model settings (dropout may
    change), and AdamW's state (another optimizer's can load, then fail at the first step)."""
    old = ckpt["meta"]
    need(all(old.get(k) == meta.get(k) for k in ("tokenizer", "vocab_size", "chars")), f"{path} was trained on "
         f"{old.get('tokenizer')} tokens of vocabulary {old.get('vocab_size')}, but this run's data has "
         f"{meta['tokenizer']} tokens of {meta['vocab_size']}: resume on the data it was trained on, or start a new "
         "out_dir")
    was = ckpt["settings"]
    diff = [k for k in GPTConfig.__dataclass_fields__ if k != "dropout" and was.get(k) != settings.get(k)]
    need(not diff, f"{path} was trained with {', '.join(f'{k}={was.get(k)!r}' for k in diff)}, but this "
         f"run asks for {', '.join(f'{k}={settings.get(k)!r}' for k in diff)}: resume with the original settings, or "
         "train from scratch in another out_dir")
    state = ckpt["optimizer"]["state"].values()
    why = next((f"no {k!r}" for st in state for k in ("step", "exp_avg", "exp_avg_sq") if k not in st), None)
    need(why is None and len(ckpt["optimizer"]["param_groups"]) == 2, f"{path}: its 'optimizer' is not this model's "
         f"AdamW state ({why or 'param groups'}): it was written by other code; resume from one that train.py wrote")


def restore(ckpt, optimizer, scaler, sampler, model, rank):
    """A resume's optimizer, GradScaler (fp16) and this rank's RNG states from ckpt (rng_states'), in place."""
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # check_resume let through what torch refuses
        raise InputError(f"the checkpoint's 'optimizer' is not this model's AdamW state ({str(e).splitlines()[0][:120]}):"
                         " resume from one that train.py wrote") from None
    if ckpt["scaler"]:  # fp16: the loss scale and its growth tracker
        scaler.load_state_dict(ckpt["scaler"])
    if not set_rng_states(ckpt["rng"], rank, sampler, model):
        print(f"rank {rank}: the checkpoint has RNG states for fewer ranks; this one continues from fresh seeds, so the "
              "run is no longer an exact continuation")


# -----------------------------------------------------------------------------
# Exact resume: every RNG state of every rank.

def rng_states(sampler, model, ddp):
    """Every RNG state of every rank, a list of RNG's dicts (a collective under DDP). numpy's and python's global
    generators are not drawn from here, but are kept too, so that code that does draw from them stays exact."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
             "python": random.getstate(), "sampler": sampler.get_state(), "sa": model.sa_state.clone()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if not ddp:
        return [state]
    states = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return [{k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for s in states]


def set_rng_states(states, rank, sampler, model):
    """rng_states' states of this rank back in place; False where the checkpoint has none for it (more ranks now)."""
    if rank >= len(states):
        return False
    s = states[rank]
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], np.uint32), *s["numpy"][2:]))
    random.setstate(s["python"])
    sampler.set_state(s["sampler"])
    model.sa_state.copy_(s["sa"])
    return True


# -----------------------------------------------------------------------------
# A train.py run's out_dir.

class RunDir:
    """out_dir of a train.py run, for its master: ckpt.pt and log.jsonl. The lock keeps a second run out while this
    one lives (the OS frees it when the process ends, even by SIGKILL). A resume from iteration n cuts the log back to
    n's eval, which it repeats, so that the log reads as one run. A run from scratch over an old ckpt.pt (overwrite)
    logs to log.jsonl.new, which its first checkpoint moves into place: until then the old pair stays whole. Ctrl-C
    waits for a checkpoint being written, then ends the run in one line that says how to resume it."""

    def __init__(self, out_dir, resume_iter=None):
        self.ckpt_path, self.log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")
        self.saved, self.resumed, self.last_iter = None, resume_iter, resume_iter or 0
        self.new_log = self.log_path + ".new" if resume_iter is None and os.path.exists(self.ckpt_path) else None
        try:
            os.makedirs(out_dir, exist_ok=True)
            self.lock = open(os.path.join(out_dir, ".lock"), "a")
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"out_dir={out_dir} is in use by another train.py run (it holds {out_dir}/.lock): wait "
                             "for it to end, or train in another --out_dir") from None
        except OSError as e:
            raise InputError(f"cannot write to out_dir={out_dir}: {e.strerror or e}") from None
        need(resume_iter is not None or os.path.exists(self.ckpt_path) == bool(self.new_log), f"{self.ckpt_path} was "
             "written by another run after this one started: train in a new --out_dir")
        for stale in (self.ckpt_path + ".tmp", self.log_path + ".new"):  # half-written files of an interrupted run
            if os.path.exists(stale):
                os.remove(stale)
        if resume_iter is not None and os.path.exists(self.log_path):
            kept = [r for r in read_log(self.log_path) if r["iter"] < resume_iter or r["iter"] == resume_iter
                    and "val_loss" not in r]
            with open(self.log_path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.log_path + ".tmp", self.log_path)
        self.log_file = open(self.new_log or self.log_path, "a" if resume_iter is not None else "w")
        signal.signal(signal.SIGINT, self.interrupted)

    def log(self, record):
        """Append a record to log.jsonl (train.py says what it holds)."""
        self.last_iter = record["iter"]
        try:
            print(json.dumps(record), file=self.log_file, flush=True)
        except OSError as e:
            raise InputError(f"cannot write {self.log_file.name}: {e.strerror or e} (disk full?); the last checkpoint "
                             f"is {self.ckpt_path if self.saved is not None else 'none'}") from None

    def save(self, ckpt):
        """Write ckpt atomically (a Ctrl-C meanwhile waits until it and the log are whole); an --overwrite run's first
        save then moves its log into place. A full disk ends the run in one line, the old checkpoint whole."""
        pending = []
        ctrl_c = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
        try:
            save_checkpoint(ckpt, self.ckpt_path)
            if self.new_log:
                self.log_file.close()
                os.replace(self.new_log, self.log_path)
                self.log_file, self.new_log = open(self.log_path, "a"), None
            self.saved = ckpt["iter_num"]
        except (OSError, RuntimeError) as e:  # torch.save's writer raises RuntimeError on a full disk
            for partial in (self.ckpt_path + ".tmp", self.new_log):  # an --overwrite run's log goes with its ckpt
                if partial and os.path.exists(partial):
                    os.remove(partial)
            raise InputError(f"cannot write {self.ckpt_path}: {str(e).splitlines()[0][:200]} (disk full?); " + (
                f"it still holds iteration {self.saved}" if self.saved is not None else "no checkpoint was saved"))
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
        if pending:
            ctrl_c(signal.SIGINT, None)

    def close(self):
        """The run's end: an --overwrite run that saved nothing drops its log, and the old pair stays."""
        self.log_file.close()
        if self.new_log:
            os.remove(self.new_log)
        kept = self.saved if self.saved is not None else self.resumed
        return (f"checkpoint {self.ckpt_path} (iteration {kept})" if kept is not None else
                "no iteration trained, no checkpoint saved" + (f"; the old {self.ckpt_path} is kept"
                                                                if self.new_log else ""))

    def interrupted(self, signum, frame):
        """Ctrl-C: one line (guards.one_line prints a KeyboardInterrupt's message) saying where the run resumes."""
        kept = self.saved if self.saved is not None else self.resumed
        args = [a for a in sys.argv[1:] if not a.startswith("--init_from=")] + ["--init_from=resume"]
        raise KeyboardInterrupt(f"interrupted after iteration {self.last_iter}: " + (
            f"{self.ckpt_path} holds iteration {kept}; continue it with `python train.py {shlex.join(args)}`"
            if kept is not None else "no checkpoint of this run was saved"))


def read_log(path):
    """log.jsonl's records. Blank lines are skipped, and so is a last line cut short (a killed run); any other line
    that is not a JSON record (or not UTF-8) stops the run with one line naming it."""
    with open(path, "rb") as f:
        lines = f.readlines()
    records = []
    for i, raw in enumerate(lines, 1):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip() or (i == len(lines) and not line.endswith("\n")):
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError too
            record = None
        need(isinstance(record, dict) and count(record.get("iter")), f"{path}:{i} is not a log record "
             f"({line.strip()[:60]!r}): delete that line, then resume again")
        records.append(record)
    return records
