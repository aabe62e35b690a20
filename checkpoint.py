"""Support, skipped on a first reading: a run's files, so nothing is lost and a resume is exact; GPT-2's weights."""
import fcntl
import json
import os
import random
import shlex
import signal
import socket
import sys
import urllib.parse
import zipfile
from dataclasses import fields, replace

import numpy as np
import torch

from guards import InputError, check_schema, count, device_problem, file_problem, memory, need, schema_problem
from model import BUILT, GPT, GPTConfig
from prepare_data import META, get_tokenizer

RNG_BYTES = torch.get_rng_state().numel()  # a CPU generator's state
SCALER = {"scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int,
          "_growth_tracker": int}  # GradScaler.state_dict() with fp16


def _words(x, n):
    return isinstance(x, (list, tuple)) and len(x) == n and all(type(w) is int and 0 <= w < 2**32 for w in x)


RNG = {  # one rank's, as rng_states writes them
    **{k: (lambda x, _: torch.is_tensor(x) and x.dtype == torch.uint8 and x.shape == (RNG_BYTES,),
           f"a uint8 tensor of shape ({RNG_BYTES},)") for k in ("torch", "sampler", "sa")},
    "cuda": (lambda x, _: torch.is_tensor(x) and x.dtype == torch.uint8 and x.dim() == 1, "a uint8 tensor"),
    "numpy": (lambda x, _: isinstance(x, (tuple, list)) and len(x) == 5 and x[0] == "MT19937" and _words(x[1], 624)
              and type(x[2]) is int and 0 <= x[2] <= 624 and x[3] in (0, 1) and isinstance(x[4], float),
              "numpy's ('MT19937', 624 words, position, has_gauss, gauss)"),
    "python": (lambda x, _: isinstance(x, tuple) and len(x) == 3 and x[0] == 3 and _words(x[1], 625)
               and (x[2] is None or isinstance(x[2], float)), "random.getstate()'s (3, 625 words, gauss)"),
}
CHECKPOINT = {  # what train.py writes into ckpt.pt
    "model_args": (lambda x, _: isinstance(x, dict) and "attn" in x and x.keys() <= set(GPTConfig.__dataclass_fields__),
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
    "rng": (lambda x, _: isinstance(x, list) and len(x) > 0 and next((f"fails for rank {i}: {p}" for i, s in
            enumerate(x) if (p := schema_problem(s, RNG, ("torch", "numpy", "python", "sampler", "sa")))), True),
            "a list of each rank's RNG states"),
}


def save_checkpoint(obj, path):
    """torch.save via a .tmp file: a crash mid-write leaves the old checkpoint whole."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, device="cpu", require=(), resume=None):
    """(model on device, ckpt on the CPU, where RNG states stay), loaded without running code; one InputError if the
    file is missing, damaged or not train.py's. require: entries besides model, model_args;
    resume=(settings, meta): all entries, check_resume, the run's dropout."""
    if resume is not None:
        require = ("optimizer", "scaler", "iter_num", "best_val_loss", "settings", "meta", "rng")
    need(not (p := file_problem(path)), f"checkpoint {path} {p}: train one with train.py")
    need(not (bad := device_problem(str(device))), f"device={device!r}: {bad}")
    try:
        with zipfile.ZipFile(path) as z:  # torch.load skips the zip's CRCs: a flipped byte would load
            damaged = z.testzip()
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise InputError(f"checkpoint {path} is unreadable ({type(e).__name__}): corrupt, or more than tensors "
                         "and plain values; restore it or train again") from None
    need(not damaged, f"checkpoint {path} is damaged: its entry {damaged} fails its checksum; restore it or train "
         "again")
    for args in (ckpt.get("model_args"), ckpt.get("settings")) if isinstance(ckpt, dict) else ():
        if isinstance(args, dict) and "sa_perm" in args:  # written before sa_perm was named sa_draw
            args["sa_draw"] = {"shared": "layer"}.get(old := args.pop("sa_perm"), old)
    check_schema(ckpt, CHECKPOINT, path, required=("model", "model_args", *require))
    try:
        with torch.device("meta"):  # shapes only: no allocation
            shapes = GPT(GPTConfig(**ckpt["model_args"]))
    except InputError as e:
        raise InputError(f"{path} has an incompatible config: {e}") from None
    want, saved, edited = shapes.state_dict(), ckpt["model"], "the file was edited or written by other code"
    bad = sorted(want.keys() ^ saved.keys()) + sorted(k for k in want.keys() & saved.keys() if (
        want[k].shape, want[k].dtype) != (saved[k].shape, saved[k].dtype))
    need(not bad, f"{path}: its weights do not fit its model_args ({len(bad)} mismatched entries, e.g. {bad[:3]}): "
         + edited)
    size = sum(t.numel() * t.element_size() for t in [*shapes.parameters(), *shapes.buffers()])  # RoPE's too
    need(size <= memory("cpu"), f"{path}: its model_args make a model of {size / 2**30:,.0f} GiB, more than this "
         f"machine has: {edited}")
    nan = [k for k, v in saved.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    need(not nan, f"{path}: {len(nan)} weights hold NaN or inf (e.g. {nan and nan[0]}): its run diverged; "
         "train again with a lower learning_rate")
    was = ckpt.get("settings", {})
    # the fields train.py takes from its settings, from GPT-2 too: block_size and the attention's
    taken = [f.name for f in fields(GPTConfig) if f.name not in BUILT] + ["block_size"]
    off = [k for k in taken if k in was and was[k] != getattr(shapes.config, k)]
    need(not off, f"{path}: its model_args have {', '.join(f'{k}={getattr(shapes.config, k)!r}' for k in off)}, its "
         f"settings {', '.join(f'{k}={was[k]!r}' for k in off)}: {edited}")
    if resume is not None:
        check_resume(path, ckpt, *resume)
    model = GPT(shapes.config if resume is None else replace(shapes.config, dropout=resume[0]["dropout"]))
    model.load_state_dict(saved)
    return model.to(device), ckpt


def check_resume(path, ckpt, settings, meta):
    """A resume's checkpoint must be this run's: tokenizer, model settings but dropout, and AdamW's state."""
    old, was, opt = ckpt["meta"], ckpt["settings"], ckpt["optimizer"]
    need(all(old.get(k) == meta.get(k) for k in ("tokenizer", "vocab_size", "chars")), f"{path} was trained on "
         f"{old.get('tokenizer')} tokens of vocabulary {old.get('vocab_size')}, but this run's data has "
         f"{meta['tokenizer']} tokens of {meta['vocab_size']}: resume on its data, or start a new out_dir")
    diff = [k for k in GPTConfig.__dataclass_fields__ if k != "dropout" and was.get(k) != settings.get(k)]
    need(not diff, f"{path} was trained with {', '.join(f'{k}={was.get(k)!r}' for k in diff)}, but this run asks for "
         f"{', '.join(f'{k}={settings.get(k)!r}' for k in diff)}: resume with those, or train in another out_dir")
    why = next((f"no {k!r}" for s in opt["state"].values() for k in ("step", "exp_avg", "exp_avg_sq") if k not in s),
               None if len(opt["param_groups"]) == 2 else "param groups")
    need(why is None, f"{path}: its 'optimizer' is not this model's AdamW state ({why}): resume from one that "
         "train.py wrote")


def restore(ckpt, optimizer, scaler, data_rng, model, rank):
    """A resume's optimizer, GradScaler and this rank's RNG states, from ckpt."""
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # what torch refuses after check_resume
        raise InputError(f"the checkpoint's 'optimizer' is not this model's AdamW state ({str(e).splitlines()[0][:120]}"
                         "): resume from one that train.py wrote") from None
    if ckpt["scaler"]:  # fp16
        scaler.load_state_dict(ckpt["scaler"])
    if rank >= len(ckpt["rng"]):
        print(f"rank {rank}: the checkpoint has RNG states for fewer ranks: this one keeps its fresh seeds")
        return
    s = ckpt["rng"][rank]
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], np.uint32), *s["numpy"][2:]))
    random.setstate(s["python"])
    data_rng.set_state(s["sampler"])  # its stored name
    model.sa_state.copy_(s["sa"])


def rng_states(data_rng, model, ddp):
    """Every rank's RNG states (a collective under DDP), numpy's and python's included."""
    name, words, *rest = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (name, words.tolist(), *rest),
             "python": random.getstate(), "sampler": data_rng.get_state(), "sa": model.sa_state.clone()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if not ddp:
        return [state]
    states = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return [{k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for s in states]


class RunDir:
    """A train.py run's out_dir, for its master. A lock (freed even on SIGKILL) keeps out a second run. A resume from
    iteration n cuts log.jsonl to before n's eval, and best_val_loss to the evals it keeps (no log: the checkpoint's),
    as an unstopped run has them (train.py evaluates n again only where it did). A new run over an old ckpt.pt logs
    to log.jsonl.new until its first checkpoint, the old pair whole. Ctrl-C waits out a checkpoint's write, then says
    how to resume."""

    def __init__(self, out_dir, resume_iter=None, best_val_loss=float("inf")):
        resume, join = resume_iter is not None, os.path.join
        self.ckpt_path, self.log_path = join(out_dir, "ckpt.pt"), join(out_dir, "log.jsonl")
        self.kept, self.last_iter = resume_iter, resume_iter or 0  # kept: the iteration this run's ckpt.pt holds
        self.best_val_loss = best_val_loss
        self.new_log = self.log_path + ".new" if not resume and os.path.exists(self.ckpt_path) else None
        try:
            os.makedirs(out_dir, exist_ok=True)
            self.lock = open(join(out_dir, ".lock"), "a")
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"out_dir={out_dir} is in use by another train.py run: wait for it, or train "
                             "in another --out_dir") from None
        except OSError as e:
            raise InputError(f"cannot write to out_dir={out_dir}: {e.strerror or e}") from None
        need(resume or os.path.exists(self.ckpt_path) == bool(self.new_log), f"{self.ckpt_path} was written by "
             "another run after this one started: train in a new --out_dir")
        _remove(self.ckpt_path + ".tmp", self.log_path + ".new")  # half-written files of an interrupted run
        if resume and os.path.exists(self.log_path):
            kept = [r for r in read_log(self.log_path) if r["iter"] < resume_iter or r["iter"] == resume_iter
                    and "val_loss" not in r]
            self.best_val_loss = min((r["val_loss"] for r in kept if isinstance(r.get("val_loss"), float)),
                                     default=float("inf"))
            with open(self.log_path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.log_path + ".tmp", self.log_path)
        self.log_file = open(self.new_log or self.log_path, "a" if resume else "w")
        signal.signal(signal.SIGINT, self.interrupted)

    def log(self, record):
        self.last_iter = record["iter"]
        try:
            print(json.dumps(record), file=self.log_file, flush=True)
        except OSError as e:
            raise InputError(f"cannot write {self.log_file.name}: {e.strerror or e} (disk full?); {self.holds()}") \
                from None

    def save(self, ckpt):
        """A full disk ends the run in one line, the old pair whole."""
        pending = []
        ctrl_c = signal.signal(signal.SIGINT, lambda *_: pending.append(True))
        try:
            save_checkpoint(ckpt, self.ckpt_path)
            if self.new_log:
                self.log_file.close()
                os.replace(self.new_log, self.log_path)
                self.log_file, self.new_log = open(self.log_path, "a"), None
            self.kept = ckpt["iter_num"]
        except (OSError, RuntimeError) as e:  # torch.save: RuntimeError on a full disk
            _remove(self.ckpt_path + ".tmp", self.new_log)
            raise InputError(f"cannot write {self.ckpt_path}: {str(e).splitlines()[0][:200]} (disk full?); "
                             + self.holds())
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
        if pending:
            ctrl_c(signal.SIGINT, None)

    def close(self):
        self.log_file.close()
        if self.new_log:
            os.remove(self.new_log)
        return (f"checkpoint {self.ckpt_path} (iteration {self.kept})" if self.kept is not None else self.holds()
                + (f"; the old {self.ckpt_path} is kept" if self.new_log else ""))

    def holds(self):  # what ckpt.pt holds, for a message
        return "this run saved no checkpoint" if self.kept is None else f"{self.ckpt_path} holds iteration {self.kept}"

    def interrupted(self, signum, frame):
        args = [a for a in sys.argv[1:] if not a.startswith("--init_from=")] + ["--init_from=resume"]
        resume = f"; continue it with `python train.py {shlex.join(args)}`" if self.kept is not None else ""
        raise KeyboardInterrupt(f"interrupted (last logged iteration {self.last_iter}): {self.holds()}{resume}")


def _remove(*paths):
    for path in paths:
        if path and os.path.exists(path):
            os.remove(path)


def read_log(path):
    """log.jsonl's records, less blank lines and a cut-short last line (a killed run); a bad line: one InputError."""
    with open(path, "rb") as f:
        lines = f.readlines()
    records = []
    for i, raw in enumerate(lines, 1):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip() or i == len(lines) and not line.endswith("\n"):
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError too
            record = None
        need(isinstance(record, dict) and count(record.get("iter")), f"{path}:{i} is not a log record "
             f"({line.strip()[:60]!r}): delete that line, then resume again")
        records.append(record)
    return records


GPT2_SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256}  # GPT-2 BPE, as fineweb-edu's meta.json has it
WEIGHT_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd", "bias", "pos_emb", "block_size")  # model.BUILT's


def from_gpt2(model_type, override_args=None):
    """nanoGPT's from_pretrained: GPT-2's weights (model_type: hub_model's name, or a GPT2LMHeadModel) in our GPT;
    override_args: fields but WEIGHT_FIELDS (sa+swa's gates: at their init)."""
    override_args, allowed = override_args or {}, GPTConfig.__dataclass_fields__.keys() - set(WEIGHT_FIELDS)
    need(override_args.keys() <= allowed, f"from_gpt2 can override only {sorted(allowed)}, got {sorted(override_args)}")
    hf = model_type if isinstance(model_type, torch.nn.Module) else hub_model(model_type)
    c, weights = hf.config, hf.state_dict()
    # the values of GPT-2's config for which our Block computes exactly what GPT-2's does
    for field, ok in (("activation_function", ("gelu_new", "gelu_pytorch_tanh")), ("layer_norm_epsilon", (1e-5,)),
                      ("n_inner", (None, 4 * c.n_embd))):
        need(getattr(c, field) in ok, f"GPT-2 config {field}={getattr(c, field)!r}: our GPT needs one of {ok}")
    model = GPT(GPTConfig(**{"attn": "full", "dropout": 0.0, **override_args}, block_size=c.n_positions, bias=True,
                          vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                          pos_emb="learned"))
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # GPT-2's (in, out)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if not k.endswith("attn.gate.weight"):
                w = weights[k].t() if k.endswith(conv1d) else weights[k]
                need(w.shape == v.shape, f"GPT-2 weight {k} has shape {tuple(w.shape)}, ours {tuple(v.shape)}")
                v.copy_(w)
    return model


def hub_model(name):
    """A transformers GPT2LMHeadModel: a size of GPT2_SIZES (from the hub or its cache) or a local directory."""
    need(name in GPT2_SIZES or os.path.isdir(name), f"unknown GPT-2 model {name!r}: use one of {', '.join(GPT2_SIZES)}"
         " or a directory of a saved GPT2LMHeadModel")
    offline = hub_offline(name)
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise InputError("loading GPT-2 weights needs transformers: pip install transformers") from None
    try:
        return GPT2LMHeadModel.from_pretrained(name)
    except OSError as e:
        why = "the Hugging Face hub is unreachable and it is not in the local cache" if offline else \
            str(e).splitlines()[0][:200]
        raise InputError(f"--init_from={name}: cannot load it ({why}); go online once, or give a local path") from None


def gpt2_tokenizer(name):
    """(encode, decode) of GPT-2 `name` (a size, or a GPT2LMHeadModel's directory): the tokenizer
    saved in the directory (transformers' files) if any, else tiktoken's gpt2, which needs the
    network once (then tiktoken caches it)."""
    saved = os.path.isdir(name) and hf_tokenizer(name, required=False)
    if saved:
        return lambda s: saved.encode(s, add_special_tokens=False), saved.decode
    try:
        return get_tokenizer(GPT2_META, name)
    except InputError as e:  # offline: a directory can hold its own tokenizer
        if not os.path.isdir(name):
            raise
        raise InputError(f"{e}; or save GPT-2's tokenizer in {name} (tokenizer.save_pretrained)") \
            from None


def hf_tokenizer(name, required=True):
    """transformers' tokenizer of a Hugging Face model (a hub name or a directory). Where the
    directory holds no tokenizer files, transformers builds one of a single token: then an
    InputError (required), else None."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError(f"--init_from={name} loads a Hugging Face model: pip install "
                         "transformers") from None
    tok = AutoTokenizer.from_pretrained(name)
    if len(tok) > 1:
        return tok
    need(not required, f"--init_from={name}: no tokenizer there (no tokenizer.json, or vocab.json "
         "and merges.txt...; transformers built one of a single token): save the model's tokenizer "
         "in it (tokenizer.save_pretrained)")
    return None


def hub_offline(name):
    """Whether HF_HUB_OFFLINE=1 (the cache only), set here before transformers is imported if name is no path and the
    hub is unreachable (else it retries for ~30 s)."""
    if not (os.path.exists(name) or os.environ.get("HF_HUB_OFFLINE") == "1"):
        hub = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        try:
            socket.create_connection((hub.hostname, hub.port or 443), timeout=5).close()
        except OSError:
            os.environ["HF_HUB_OFFLINE"] = "1"
    return os.environ.get("HF_HUB_OFFLINE") == "1"
