"""
Support, which a first reading skips. Datasets: text -> tokens -> data_root/<dataset>/{train,val}.bin (nanoGPT's)
and meta.json, and their loading for train.py, sample.py and eval.py.

  python prepare_data.py  # pystdlib: Python's standard library, offline
  python prepare_data.py --dataset=mqar  # synthetic associative recall, offline
  python prepare_data.py --dataset=shakespeare_char  # downloads ~1 MB
  python prepare_data.py --dataset=fineweb-edu  # via `datasets`; GPT-2 BPE
  python prepare_data.py --dataset=wikitext-103  # the same, with a test split
  python prepare_data.py --input_file=notes.txt [--tokenizer=gpt2] [--dataset=notes]
"""
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import sys
import sysconfig

import numpy as np

from guards import InputError, check_schema, count, file_problem, memory, need, nearest_dir, schema_problem, shown

# -----------------------------------------------------------------------------
dataset = ""  # DATASETS, or any name with --input_file or --adopt ("": input_file's stem, else pystdlib)
input_file = ""
tokenizer = "bytes"  # --input_file's or --adopt's: bytes, chars (not --adopt) or a tiktoken encoding (gpt2)
data_root = "data"
val_fraction = 0.1  # val's share of the files (pystdlib) or the text (--input_file, shakespeare_char)
adopt = False  # write meta.json for nanoGPT's train.bin/val.bin in data_root/<dataset>/
mqar_seq_len = 64  # see prepare_mqar; defaults: config/mqar.py's data
mqar_num_pairs = 4
mqar_num_queries = 4
mqar_vocab = 32
mqar_train_seqs = 1000  # a sample: train.py makes fresh sequences every batch
mqar_val_seqs = 1000
mqar_seed = 0
mqar_ordered = False
mqar_offset = 0  # 1: no MoBA chunk of 2 tokens holds a whole pair
hf_max_docs = 0  # fineweb-edu: documents read, val's included (0: all, ~10B tokens, ~20 GB)
hf_val_docs = 5000  # fineweb-edu: the first documents, as val
# -----------------------------------------------------------------------------

# Each named dataset and how it is written into data_dir from this script's settings s: a new one is a line here
DATASETS = {
    "pystdlib": lambda data_dir, s: prepare_pystdlib(data_dir, s["val_fraction"]),
    "mqar": lambda data_dir, s: prepare_mqar(data_dir, **{k[5:]: s[k] for k in s if k.startswith("mqar_")}),
    "shakespeare_char": lambda data_dir, s: prepare_shakespeare_char(data_dir, s["val_fraction"]),
    "fineweb-edu": lambda data_dir, s: prepare_fineweb_edu(data_dir, s["hf_max_docs"], s["hf_val_docs"]),
    "wikitext-103": lambda data_dir, s: prepare_wikitext_103(data_dir),
}
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}  # not in pystdlib
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


# Loading, for the other scripts

def prepare_command(data_dir, args=None):
    root, name = os.path.split(os.path.normpath(data_dir))
    args = ("" if name in DATASETS else "--input_file=FILE ") if args is None else args
    return f"`python prepare_data.py {args}--dataset={name}{f' --data_root={root}' * (root != 'data')}`"


def dataset_dir(data_root, name):
    need(isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name,
         f"dataset={name!r}: use a plain name, no path")
    return os.path.join(data_root, name)


def _mqar(m, meta):
    """META's test of the mqar entry."""
    ints = ("seq_len", "num_pairs", "num_queries", "num_keys", "min_gap")
    if not (isinstance(m, dict) and all(type(m.get(k)) is int for k in ints) and type(m.get("ordered", False)) is bool
            and count(m.get("offset", 0)) and count(m.get("seed", 0))):
        return False
    try:
        layout = mqar_layout(*(m[k] for k in ints[:3]), meta["vocab_size"], m.get("ordered", False), m.get("offset", 0))
    except InputError as e:
        return f"is impossible: {e}"
    if (m["num_keys"], m["min_gap"]) != layout:
        return f"has (num_keys, min_gap) = {m['num_keys'], m['min_gap']}, not its layout's {layout}"
    return not any(n % m["seq_len"] for n in meta.get("tokens", {}).values()) or f"needs whole sequences of " \
        f"{m['seq_len']} tokens; tokens={shown(meta['tokens'])}"


TOKEN_BITS = {"uint8": 8, "uint16": 16, "uint32": 32}  # a .bin's token id types
VOCAB = {"bytes": 256, "gpt2": 50257, "r50k_base": 50257, "p50k_base": 50281, "p50k_edit": 50284, "cl100k_base": 100277,
         "o200k_base": 200019, "o200k_harmony": 201088}  # fixed vocabularies (tiktoken's n_vocab), known offline
META = {  # meta.json's entries: {entry: (test, what it must be)}
    "vocab_size": (lambda V, m: count(V) and 1 <= V <= 2**32 and (V == (n := VOCAB.get(str(m.get("tokenizer")), V))
                   or f"is {V}, not the {n} ids of {m['tokenizer']}"), "an integer from 1 to 2**32"),
    "tokenizer": (lambda x, m: isinstance(x, str) and x != "" and (x != "chars" or "chars" in m or "is 'chars', "
                  f"without chars, the {m['vocab_size']} distinct characters of its tokens"), "a tokenizer's name"),
    "chars": (lambda x, m: isinstance(x, str) and len(set(x)) == len(x) == m["vocab_size"] or f"is {shown(x)}, not "
              f"the {m['vocab_size']} distinct characters of its tokens", None),
    "dtype": (lambda x, m: x in TOKEN_BITS and m["vocab_size"] <= 2 ** TOKEN_BITS[x] or f"is {shown(x)}, which cannot "
              "hold token ids: use " + " or ".join(t for t in TOKEN_BITS if m["vocab_size"] <= 2 ** TOKEN_BITS[t])
              + f" (vocab_size {m['vocab_size']})", None),
    "tokens": (lambda x, m: isinstance(x, dict) and x and all(isinstance(k, str) and count(n) for k, n in x.items()),
               "a map of each split to its token count"),
    "eot": (lambda x, m: x is None or count(x) and x < m["vocab_size"] or f"is {shown(x)}, not a token id below "
            f"vocab_size {m['vocab_size']}", None),
    "source": (lambda x, m: isinstance(x, str), "a text"),
    "files": (lambda x, m: isinstance(x, dict) and all(map(count, x.values())), "a map of each split to its files"),
    "mqar": (_mqar, "an MQAR layout (prepare_mqar's)"),
}


def load_meta(data_dir):
    """data_dir's meta.json, checked (META, and a tokenizer this repo knows)."""
    path, fix = os.path.join(data_dir, "meta.json"), prepare_command(data_dir)
    if not os.path.isfile(path):
        need(not os.path.isfile(os.path.join(data_dir, "train.bin")), f"{path} not found, but train.bin is (nanoGPT "
             f"data?): {prepare_command(data_dir, '--adopt=True --tokenizer=gpt2 ')}")
        raise InputError(f"{path} not found: prepare the dataset first with {fix}")
    try:
        meta = json.loads(pathlib.Path(path).read_text("utf-8"))
    except ValueError as e:  # not JSON, not UTF-8
        raise InputError(f"{path} is corrupt or not from this repo ({type(e).__name__}: {str(e)[:100]}): re-run "
                         f"{fix}") from None
    check_schema(meta, META, path, required=("vocab_size", "tokenizer", "dtype", "tokens"))
    need(meta["tokenizer"] in ("bytes", "chars", "ids", *tiktoken_names()), f"{path} has tokenizer="
         f"{meta['tokenizer']!r}, which this repo cannot load: re-run {fix}")
    return meta


def load_tokens(data_dir, split, meta, least=1):
    """A read-only np.memmap of a split of at least `least` tokens, checked against meta."""
    path, fix = os.path.join(data_dir, f"{split}.bin"), f"re-run {prepare_command(data_dir)}"
    need(split in meta["tokens"], f"{data_dir} has no {split!r} split (it has {', '.join(meta['tokens'])})")
    need(not (p := file_problem(path)), f"{path} {p}: {fix}")
    dtype, n, V = np.dtype(meta["dtype"]), meta["tokens"][split], meta["vocab_size"]
    need(os.path.getsize(path) == n * dtype.itemsize, f"{path} holds {os.path.getsize(path)} bytes, not meta.json's "
         f"{n} {dtype} tokens: truncated or corrupt; {fix}")
    need(n > 0, f"{path} is empty: {fix} with more text")
    need(n >= least, f"block_size={least - 1} is larger than the data: {path} holds {n} tokens; lower "
         "--block_size or prepare more data")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for i in range(0, n, 1 << 24):  # in pieces: memory stays small
        piece = tokens[i:i + (1 << 24)]
        if piece.max() >= V:
            at = i + int(np.argmax(piece >= V))
            raise InputError(f"{path} holds token id {tokens[at]} at token {at}, but vocab_size is {V}: {fix}")
    return tokens


def load_data(data_dir, block_size, copy_task=False):
    """(meta, {split: tokens}, T): T is block_size, or the MQAR sequences' seq_len."""
    meta = load_meta(data_dir)
    T = meta["mqar"]["seq_len"] if "mqar" in meta else block_size
    need(not copy_task or "mqar" not in meta, f"copy_task=True needs text: {data_dir} holds MQAR sequences")
    need(T <= block_size, f"block_size={block_size} is smaller than the MQAR sequences: use --block_size={T}")
    least = T + ("mqar" not in meta)  # text: a sequence and its next token; MQAR: whole sequences
    return meta, {split: load_tokens(data_dir, split, meta, least) for split in ("train", "val")}, T


def task_metrics(logits, y, meta, copy_task=False):
    """One batch's measures, to sum over batches and divide by "n": MQAR's answer accuracy (acc); the copy task's
    mean loss on targets 0 .. T/2-2 (first) and on the copies (second)."""
    import torch.nn.functional as F
    if "mqar" in meta:
        scored = y != -1
        return {"acc": (logits.argmax(-1)[scored] == y[scored]).sum().item(), "n": scored.sum().item()}
    if copy_task:
        nll = F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=-1, reduction="none")  # (B, T)
        half = y.shape[1] // 2
        return {"first": nll[:, :half - 1].mean().item(), "second": nll[:, half - 1:-1].mean().item(), "n": 1}
    return {}


def get_tokenizer(meta, source=""):
    """(encode, decode) for meta's tokenizer ("ids": decimal numbers); decode drops ids past the vocabulary (a
    model's is padded). Errors name source, meta's origin."""
    check_schema(meta, META, f"{source or 'the tokenizer'}: its meta", required=("vocab_size", "tokenizer"))
    name, n = meta["tokenizer"], meta["vocab_size"]
    known = lambda ids: [i for i in ids if i < n]  # META: n is 256 for bytes, len(chars) for chars
    if name == "bytes":
        return lambda s: list(s.encode("utf-8")), lambda ids: bytes(known(ids)).decode("utf-8", errors="replace")
    if name == "chars":
        stoi = {c: i for i, c in enumerate(meta["chars"])}

        def encode(s):
            unknown = "".join(sorted(set(s) - stoi.keys()))
            need(not unknown, f"characters {unknown!r} are not in this dataset's vocabulary")
            return [stoi[c] for c in s]
        return encode, lambda ids: "".join(meta["chars"][i] for i in known(ids))
    if name == "ids":
        def encode(s):
            need(all(t.isascii() and t.isdigit() for t in s.split()),  # "²" is a digit to isdigit, not to int
                 f"this dataset's tokens are numbers: write the prompt as e.g. '3 17 4', not {s[:40]!r}")
            return [int(t) for t in s.split()]
        return encode, lambda ids: " ".join(map(str, known(ids)))
    enc = tiktoken_encoding(name, f"{source}: " * bool(source))
    return lambda s: enc.encode(s, allowed_special={"<|endoftext|>"}), lambda ids: enc.decode(known(ids))


def mqar_targets(x, meta):
    """Targets of MQAR sequences x (..., seq_len): at each query the value paired with its cue, else -1."""
    m = meta["mqar"]
    P, half, o = m["num_pairs"], m["seq_len"] // 2, m.get("offset", 0)
    cues, values = x[..., o:o + 2 * P:2], x[..., o + 1:o + 2 * P:2]  # (..., P) each
    match = x[..., half:, None] == cues[..., None, :]  # (..., T/2, P); filler 0 is no cue
    y = np.full_like(x, -1)
    y[..., half:] = np.where(match.any(-1), (match * values[..., None, :]).sum(-1), -1)
    return y


def mqar_batch(rng, n, meta):
    """n fresh MQAR sequences made with numpy Generator rng: (x, y) int64 (n, seq_len) each."""
    m, V = meta["mqar"], meta["vocab_size"]
    T, P, Q, C, o = m["seq_len"], m["num_pairs"], m["num_queries"], m["num_keys"], m.get("offset", 0)
    firsts = lambda lo, hi, k: rng.permuted(np.tile(np.arange(lo, hi), (n, 1)), axis=1)[:, :k]  # k distinct per row
    cues, values = firsts(1, C + 1, P), firsts(C + 1, V, P)  # (n, P) each
    x = np.zeros((n, T), np.int64)  # (n, T), filler 0
    x[:, o:o + 2 * P:2], x[:, o + 1:o + 2 * P:2] = cues, values
    if m.get("ordered"):
        x[:, T // 2:T // 2 + 2 * P:2] = cues
    else:  # a cue asked twice is a second, wrong source of its value: learning slows a lot
        where = firsts(T // 2, T, Q)  # (n, Q) query positions
        asked = firsts(0, P, Q) if Q <= P else rng.integers(P, size=(n, Q))  # (n, Q) pair each query asks for
        np.put_along_axis(x, where, np.take_along_axis(cues, asked, 1), 1)
    return x, mqar_targets(x, meta)


# Tokenise and write

def tiktoken_names():
    try:
        import tiktoken
    except ImportError:
        return []
    return tiktoken.list_encoding_names()


def tiktoken_encoding(name, where=""):
    """tiktoken's encoding `name`; errors start with `where`."""
    names = tiktoken_names()
    need(names, f"{where}the {name} tokenizer needs tiktoken: pip install tiktoken")
    need(name in names, f"{where}unknown tokenizer {name!r}: use bytes, chars or a tiktoken encoding "
         f"({', '.join(names)})")
    import tiktoken
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # offline at first use
        raise InputError(f"{where}tiktoken could not load the {name!r} encoding ({type(e).__name__}: {str(e)[:200]})"
                         ": go online once (it caches), or set TIKTOKEN_CACHE_DIR") from None


def progress(iterable, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:
        print("(pip install tqdm for a progress bar)")
        return iterable
    return tqdm(iterable, **kwargs)


def pyplot(purpose):
    """matplotlib.pyplot, drawing to files."""
    try:
        import matplotlib
    except ImportError:
        raise InputError(f"{purpose} needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def text_tokenizer(name, text=None):
    """(meta fields, encode_batch: documents -> their ids, eot or None); chars's vocabulary is `text`'s."""
    if name == "bytes":
        enc = lambda d: np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), np.uint8)
        return {"tokenizer": "bytes", "vocab_size": 256}, lambda docs: [enc(d) for d in docs], None
    if name == "chars":
        chars = "".join(sorted(set(text)))
        fields = {"tokenizer": "chars", "vocab_size": len(chars), "chars": chars}
        encode = get_tokenizer(fields)[0]
        return fields, lambda docs: [encode(d) for d in docs], None
    enc = tiktoken_encoding(name)
    return ({"tokenizer": name, "vocab_size": enc.n_vocab},
            lambda docs: enc.encode_ordinary_batch(list(docs), num_threads=os.cpu_count() or 1), enc.eot_token)


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 65535 else np.uint32


@contextlib.contextmanager
def writing(data_dir, meta):
    """{split: <split>.bin.tmp} to fill: removed if that fails or a split is empty, else moved into place while no
    meta.json marks the dataset complete."""
    tmps = {split: os.path.join(data_dir, f"{split}.bin.tmp") for split in meta["tokens"]}
    try:
        yield tmps
        need(all(meta["tokens"].values()), f"the {' and '.join(s for s, n in meta['tokens'].items() if not n)} split "
             f"of {data_dir} would be empty: nothing written")
    except BaseException:
        for path in tmps.values():
            pathlib.Path(path).unlink(missing_ok=True)
        raise
    pathlib.Path(data_dir, "meta.json").unlink(missing_ok=True)
    for path in tmps.values():
        os.replace(path, path[:-4])
    write_meta(data_dir, meta)


def write_meta(data_dir, meta):
    path, problem = os.path.join(data_dir, "meta.json"), schema_problem(meta, META)
    need(problem is None, f"{path} would be refused: {problem}")
    pathlib.Path(path + ".tmp").write_text(json.dumps(meta, indent=1))
    os.replace(path + ".tmp", path)
    counts = ", ".join(f"{n:,} {split}" for split, n in meta["tokens"].items())
    print(f"wrote {data_dir}: {counts} tokens, vocab {meta['vocab_size']} ({meta['tokenizer']}), {meta['dtype']}")
    return meta


def write_dataset(data_dir, splits, tok, source, batch_docs=1024, **extra):
    """Each split's documents (str or bytes) to <split>.bin, tokenised by tok = text_tokenizer(...), eot (if any)
    after each."""
    fields, encode_batch, eot = tok
    dtype = token_dtype(fields["vocab_size"])
    meta = {**fields, "dtype": np.dtype(dtype).name, "source": source, "tokens": dict.fromkeys(splits, 0), "eot": eot,
            **extra}
    os.makedirs(data_dir, exist_ok=True)
    with writing(data_dir, meta) as tmps:
        for split, docs in splits.items():
            docs = iter(progress(docs, desc=split, unit=" docs", mininterval=2))
            with open(tmps[split], "wb") as f:
                while batch := list(itertools.islice(docs, batch_docs)):
                    meta["tokens"][split] += write_batch(f, encode_batch(batch), eot, dtype)
    return meta


def write_batch(f, ids, eot, dtype):
    tail = () if eot is None else ([eot],)
    arr = np.concatenate([np.zeros(0, dtype)] + [np.asarray(x, dtype) for a in ids for x in (a, *tail)])
    f.write(arr.tobytes())
    return len(arr)


def write_text(data_dir, text, tokenizer_name, frac, source):
    """The last `frac` of the text is val (nanoGPT's shakespeare split)."""
    cut = int(len(text) * (1 - frac))
    need(0 < cut < len(text), f"{source} is too short to split into train and val with val_fraction={frac}")
    return write_dataset(data_dir, {"train": [text[:cut]], "val": [text[cut:]]}, text_tokenizer(tokenizer_name, text),
                         source=source)


# Datasets

def prepare_text(data_dir, path, tokenizer_name, frac):
    need(not (p := file_problem(path)), f"--input_file={path} {p}")
    raw = pathlib.Path(path).read_bytes()
    try:
        text = raw if tokenizer_name == "bytes" else raw.decode("utf-8")  # bytes stay exact
    except UnicodeDecodeError as e:
        raise InputError(f"--input_file={path} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}): "
                         f"use --tokenizer=bytes") from None
    need(text, f"--input_file={path} is empty")
    return write_text(data_dir, text, tokenizer_name, frac, path)


def pystdlib_files(root):
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # pruned: site-packages can be huge
        files += [pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def prepare_pystdlib(data_dir, frac, root=None):
    """Python's standard library, as bytes."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = pystdlib_files(root)
    need(files, f"no *.py files under {root}: use a Python with its standard library sources")
    is_val = [int((i + 1) * frac) > int(i * frac) for i in range(len(files))]
    splits = {s: [p.read_bytes() for p, v in zip(files, is_val) if v == (s == "val")] for s in ("train", "val")}
    return write_dataset(data_dir, splits, text_tokenizer("bytes"), batch_docs=64,
                         source=f"pystdlib: {len(files)} *.py files of Python {sys.version.split()[0]} under {root}",
                         files={s: len(docs) for s, docs in splits.items()})


def mqar_layout(seq_len, num_pairs, num_queries, vocab, ordered, offset):
    """(num_keys, min_gap) of prepare_mqar's layout, or the rule it breaks."""
    C, room = (vocab - 1) // 2, seq_len // 2 - 2 * num_pairs  # room: filler before the second half
    need(1 <= num_pairs <= C and 1 <= num_queries <= seq_len - seq_len // 2 and room >= 0, f"mqar needs 1 <= "
         f"num_pairs ({num_pairs}) <= (vocab-1)//2 ({C}), 1 <= num_queries ({num_queries}) <= seq_len - seq_len // 2 "
         f"and seq_len ({seq_len}) >= 4 * num_pairs")
    need(0 <= offset <= room, f"mqar needs 0 <= mqar_offset ({offset}) <= seq_len // 2 - 2 * num_pairs ({room})")
    need(not ordered or num_queries == num_pairs, f"mqar_ordered needs num_queries = num_pairs ({num_pairs})")
    return C, seq_len // 2 - 1 - offset if ordered else room + 1 - offset


def prepare_mqar(data_dir, seq_len, num_pairs, num_queries, vocab, train_seqs, val_seqs, seed, ordered=False, offset=0):
    """Multi-query associative recall, Zoology's layout (Arora et al. 2023):

        c1 v1 c2 v2 ... cP vP  0 0 ... 0  |  0 q 0 0 q q 0 ... q 0   (| = seq_len // 2)

    P pairs of distinct cues (MQAR's keys: meta's num_keys) from [1, C] and values from [C+1, vocab), after `offset`
    0s; then num_queries cues (distinct pairs if num_queries <= P) at random positions, min_gap (mqar_layout) or
    more after their values: SWA of reach n_layer * (w - 1) < min_gap can only guess. ordered=True asks pair i at
    seq_len // 2 + 2i."""
    C, min_gap = mqar_layout(seq_len, num_pairs, num_queries, vocab, ordered, offset)
    n, name = max((train_seqs, "mqar_train_seqs"), (val_seqs, "mqar_val_seqs"))
    # ram: mqar_batch's arrays, measured within 1.6x
    ram, have = n * (8 * (2 * vocab + 3 * seq_len + seq_len * num_pairs // 2) + seq_len * num_pairs // 2), memory("cpu")
    need(ram <= have, f"{name}={n}: making {n:,} sequences of {seq_len} tokens (vocab {vocab:,}) takes about "
         f"{ram / 2**30:,.0f} GiB of memory, of {have / 2**30:,.0f} GiB here: use fewer, or a smaller mqar_vocab")
    tokens, dtype, where = (train_seqs + val_seqs) * seq_len, token_dtype(vocab), nearest_dir(data_dir)
    need(where, f"{data_dir}: a file is in the way: choose another --data_root")
    disk, free = tokens * np.dtype(dtype).itemsize, shutil.disk_usage(where).free
    need(disk <= free, f"mqar_train_seqs={train_seqs}, mqar_val_seqs={val_seqs}: their {tokens:,} tokens take "
         f"{disk / 2**20:,.0f} MiB on disk, but {where} has {free / 2**20:,.0f} MiB free: use fewer")
    os.makedirs(data_dir, exist_ok=True)
    meta = dict(vocab_size=vocab, tokenizer="ids", dtype=np.dtype(dtype).name, source=f"synthetic MQAR, seed {seed}",
                tokens={"train": train_seqs * seq_len, "val": val_seqs * seq_len}, eot=None, mqar=dict(
                    seq_len=seq_len, num_pairs=num_pairs, num_queries=num_queries, num_keys=C, min_gap=min_gap,
                    seed=seed, ordered=ordered, offset=offset))
    with writing(data_dir, meta) as tmps:
        for path, n, rng in zip(tmps.values(), (train_seqs, val_seqs), np.random.default_rng(seed).spawn(2)):
            mqar_batch(rng, n, meta)[0].astype(dtype).tofile(path)  # (n, seq_len)
    return meta


def download_text(url):
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            pieces = list(progress(iter(lambda: r.read(1 << 16), b""), desc="download", unit=" pieces"))
    except OSError as e:  # URLError too
        raise InputError(f"could not download {url} ({getattr(e, 'reason', e)}); offline? fetch it by hand and "
                         "pass it as --input_file=FILE --tokenizer=chars --dataset=shakespeare_char") from None
    return b"".join(pieces).decode("utf-8")


def hf_dataset(path, name, split, streaming=False, alt=""):
    """A Hugging Face dataset; its errors end with alt (", or ...")."""
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path} needs the `datasets` package: pip install datasets{alt}") from None
    try:
        return datasets.load_dataset(path, name, split=split, streaming=streaming)
    except Exception as e:  # offline: one of several types
        first = (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"could not load {path} ({type(e).__name__}: {first}): check the network, or set "
                         f"HF_DATASETS_OFFLINE=1 to use its cache{alt}") from None


def prepare_shakespeare_char(data_dir, frac):
    return write_text(data_dir, download_text(SHAKESPEARE_URL), "chars", frac, SHAKESPEARE_URL)


def prepare_fineweb_edu(data_dir, max_docs, val_docs):
    """FineWeb-Edu's sample-10BT, streamed."""
    stream = hf_dataset("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", streaming=True)
    texts = (row["text"] for row in (itertools.islice(stream, max_docs) if max_docs else stream))
    val = [next(texts) for _ in range(val_docs)]  # a stream is read once: val off its head
    return write_dataset(data_dir, {"val": val, "train": texts}, text_tokenizer("gpt2"),
                         source=f"HuggingFaceFW/fineweb-edu sample-10BT, first {val_docs} docs as val")


def prepare_wikitext_103(data_dir):
    """WikiText-103 (raw), its own splits. Rows are lines of the articles: joined with no eot."""
    splits = {ours: (row["text"] for row in hf_dataset("Salesforce/wikitext", "wikitext-103-raw-v1", theirs))
              for ours, theirs in (("train", "train"), ("val", "validation"), ("test", "test"))}
    return write_dataset(data_dir, splits, text_tokenizer("gpt2")[:2] + (None,),
                         source="Salesforce/wikitext wikitext-103-raw-v1")


def adopt_nanogpt(data_dir, tokenizer_name):
    """meta.json for nanoGPT's train.bin/val.bin (uint16) in data_dir, once every id fits the tokenizer."""
    need(tokenizer_name != "chars", "tokenizer='chars': --adopt needs a tokenizer with a fixed vocabulary (bytes or "
         "tiktoken's)")
    fields, _, eot = text_tokenizer(tokenizer_name)
    counts = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        need(os.path.isfile(path) and os.path.getsize(path) % 2 == 0, f"{path} is missing or not a uint16 token file")
        counts[split] = os.path.getsize(path) // 2
    meta = {**fields, "dtype": "uint16", "source": f"adopted nanoGPT data in {data_dir}", "tokens": counts, "eot": eot}
    for split in counts:
        load_tokens(data_dir, split, meta)
    return write_meta(data_dir, meta)


if __name__ == "__main__":
    exec(open("configurator.py").read())  # every setting's type and range (guards.CHECKS)
    name = dataset or (pathlib.Path(input_file).stem if input_file else "pystdlib")
    data_dir = dataset_dir(data_root, name)
    need(adopt or input_file or name in DATASETS, f"unknown dataset {name!r}: choose {', '.join(DATASETS)}, or "
         "--input_file=FILE")
    try:  # an OSError (a read-only or full disk) is one line too
        if adopt:
            adopt_nanogpt(data_dir, tokenizer)
        elif input_file:
            prepare_text(data_dir, input_file, tokenizer, val_fraction)
        else:
            DATASETS[name](data_dir, {k: globals()[k] for k in setting_names})
    except OSError as e:
        sys.exit(f"cannot write {e.filename or data_dir}: {e.strerror or e}")
