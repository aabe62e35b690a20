"""
Support, which a first reading skips. Prepare a dataset: text -> tokens -> data_root/<dataset>/{train,val}.bin and
meta.json; and read one back for train.py, sample.py and eval.py.

  python prepare_data.py                                # pystdlib: the Python standard library, offline
  python prepare_data.py --dataset=mqar                 # synthetic associative recall, offline
  python prepare_data.py --dataset=shakespeare_char     # downloads (~1 MB)
  python prepare_data.py --dataset=fineweb-edu          # downloads via `datasets`; GPT-2 BPE
  python prepare_data.py --dataset=wikitext-103         # downloads via `datasets`; GPT-2 BPE, with a test split
  python prepare_data.py --input_file=notes.txt [--tokenizer=gpt2] [--dataset=notes]

The format is nanoGPT's, so that its data can be reused by writing a meta.json for it (--adopt=True). meta.json
is written last, so a dataset without it is incomplete, and a failed write (a full disk) leaves the old dataset
whole. The loaders (load_meta, load_tokens, load_data, get_tokenizer) check what they read, once, against META (and
every token id), and raise one InputError line that names the file and the fix. draw_batch and task_metrics are the
training batches and their measures: plain text, the copy task, MQAR.
"""
import contextlib
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile

import numpy as np

from guards import InputError, check_schema, count, need, schema_problem, shown

# -----------------------------------------------------------------------------
dataset = ""             # pystdlib, mqar, shakespeare_char, fineweb-edu or wikitext-103 ("": pystdlib or --input_file)
input_file = ""          # a local text file to turn into a dataset instead
tokenizer = "bytes"      # for --input_file: bytes | chars | gpt2 (or another tiktoken encoding)
data_root = "data"       # datasets go to data_root/<dataset>/
val_fraction = 0.1       # share of files (pystdlib) or of the text (--input_file, shakespeare_char) held out
adopt = False            # write a meta.json for existing nanoGPT train.bin/val.bin in data_root/<dataset>/
# mqar: num_pairs key-value pairs, filler, then num_queries keys asked at random positions of the second
# half. The defaults are config/mqar.py's recipe
mqar_seq_len = 64        # tokens per sequence
mqar_num_pairs = 4       # key-value pairs at the start of each sequence
mqar_num_queries = 4     # scored queries per sequence, each asking another pair (random ones if more than the pairs)
mqar_vocab = 32          # token 0 is filler, then keys, then values, half and half
mqar_train_seqs = 1000   # sequences in train.bin, a sample: train.py draws fresh ones every batch
mqar_val_seqs = 1000     # sequences in val.bin
mqar_seed = 0            # the generator's seed (val uses its own stream)
mqar_ordered = False     # ask every pair once, in order, at a fixed distance (a copy task: position finds the answer)
mqar_offset = 0          # the pairs start at this token (1: no MoBA block of 2 tokens holds a whole pair)
hf_max_docs = 0          # fineweb-edu: stop after this many documents (0: all of sample-10BT, ~10B tokens, ~20 GB)
hf_val_docs = 5000       # fineweb-edu: the first documents of the stream are held out as val
# -----------------------------------------------------------------------------

DATASETS = ("pystdlib", "mqar", "shakespeare_char", "fineweb-edu", "wikitext-103")  # the ones built here by name
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}  # pystdlib leaves these out
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TOKENIZERS = ("bytes", "chars", "ids")  # get_tokenizer's own; any other name is a tiktoken encoding


# -----------------------------------------------------------------------------
# Loading, for the other scripts

def prepare_command(data_dir):
    """The command that (re)builds the dataset in data_dir."""
    name = os.path.basename(os.path.normpath(data_dir))
    if name in DATASETS:
        return f"`python prepare_data.py --dataset={name}`"
    return f"`python prepare_data.py --input_file=FILE --dataset={name}` on your text FILE"


def dataset_dir(data_root, name):
    """data_root/name. A dataset is a plain name: "" or a path would read or write somewhere else."""
    need(isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name, f"dataset={name!r}: "
         f"use a plain name, no path: a dataset is the directory {os.path.join(data_root, '<dataset>')}/")
    return os.path.join(data_root, name)


def _mqar(m, meta):
    """Whether meta's mqar entry is a layout prepare_mqar writes (its types, mqar_layout's rules and the num_keys and
    min_gap they give, whole sequences in every split), or what is wrong."""
    if not (isinstance(m, dict) and all(type(m.get(k)) is int for k in ("seq_len", "num_pairs", "num_queries",
                                                                         "num_keys", "min_gap"))
            and type(m.get("ordered", False)) is bool and count(m.get("offset", 0)) and count(m.get("seed", 0))):
        return False
    try:
        layout = mqar_layout(m["seq_len"], m["num_pairs"], m["num_queries"], meta["vocab_size"], m.get("ordered", False),
                             m.get("offset", 0))
    except InputError as e:
        return f"is impossible: {e}"
    if (m["num_keys"], m["min_gap"]) != layout:
        return f"has num_keys={m['num_keys']}, min_gap={m['min_gap']}, not its layout's {layout[0]}, {layout[1]}"
    return not any(n % m["seq_len"] for n in meta.get("tokens", {}).values()) or f"needs whole sequences of " \
        f"{m['seq_len']} tokens; tokens={shown(meta['tokens'])}"


TOKEN_BITS = {"uint8": 8, "uint16": 16, "uint32": 32}  # a .bin's token ids: unsigned, wide enough for the vocabulary
META = {  # meta.json's entries (write_dataset says what each holds): {entry: (test, what it must be)}
    "vocab_size": (lambda V, m: count(V) and 1 <= V <= 2**32 and (m.get("tokenizer") != "bytes" or V == 256 or
                                                                   f"is {V}, not the 256 ids of bytes"),
                   "an integer from 1 to 2**32"),
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
    "files": (lambda x, m: isinstance(x, dict) and all(map(count, x.values())), "a map of each split to its file "
              "count"),
    "mqar": (_mqar, "an MQAR layout (seq_len, num_pairs, num_queries, num_keys, min_gap: integers; ordered: a bool; "
             "offset, seed)"),
}


def load_meta(data_dir):
    """data_dir's meta.json, after checking every entry (META) and that this repo can load its tokenizer."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        need(not os.path.isfile(os.path.join(data_dir, "train.bin")), f"{path} not found, but train.bin is there "
             f"(nanoGPT data?): describe it with `python prepare_data.py --adopt=True --dataset="
             f"{os.path.basename(os.path.normpath(data_dir))} --tokenizer=gpt2`")
        raise InputError(f"{path} not found: prepare the dataset first with {prepare_command(data_dir)}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as e:  # not JSON, not UTF-8
        raise InputError(f"{path} is corrupt or not from this repo ({type(e).__name__}: {str(e)[:100]}): "
                         f"re-run {prepare_command(data_dir)}") from None
    check_schema(meta, META, path, required=("vocab_size", "tokenizer", "dtype", "tokens"))
    need(meta["tokenizer"] in TOKENIZERS or meta["tokenizer"] in tiktoken_names(), f"{path} has tokenizer="
         f"{meta['tokenizer']!r}, which this repo cannot load: re-run {prepare_command(data_dir)}")
    return meta


def load_tokens(data_dir, split, meta, least=1):
    """A read-only np.memmap of one split of at least `least` tokens, after checking its size and every id against
    meta (load_meta's): once, when it is opened, in chunks, so that memory stays small."""
    path = os.path.join(data_dir, f"{split}.bin")
    fix = f"re-run {prepare_command(data_dir)}"
    need(split in meta["tokens"], f"{data_dir} has no {split!r} split (it has {', '.join(meta['tokens'])})")
    need(os.path.isfile(path), f"{path} is missing: {fix}")
    dtype, n, V = np.dtype(meta["dtype"]), meta["tokens"][split], meta["vocab_size"]
    need(os.path.getsize(path) == n * dtype.itemsize, f"{path} holds {os.path.getsize(path)} bytes, but meta.json "
         f"promises {n} {dtype} tokens ({n * dtype.itemsize} bytes): the file is truncated or corrupt; {fix}")
    need(n > 0, f"{path} is empty: {fix} with more text")
    need(n >= least, f"block_size={least - 1} is larger than the data: {path} holds only {n} tokens; lower "
         "--block_size or prepare more data")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for i in range(0, n, 1 << 24):
        chunk = tokens[i:i + (1 << 24)]
        if chunk.max() >= V:
            at = i + int(np.argmax(chunk >= V))
            raise InputError(f"{path} holds token id {tokens[at]} at token {at}, but vocab_size is {V}: it does not "
                             f"belong to this meta.json; {fix}")
    return tokens


def load_data(data_dir, block_size, copy_task=False):
    """(meta, {split: tokens}, T) for training on data_dir: T tokens a sequence, block_size or the MQAR sequences'
    seq_len, which must fit in block_size; the copy task (two halves of T/2) needs text."""
    meta = load_meta(data_dir)
    T = meta["mqar"]["seq_len"] if "mqar" in meta else block_size
    need(not copy_task or "mqar" not in meta, f"copy_task=True builds its sequences from text: {data_dir} holds MQAR "
         "sequences")
    need(T <= block_size, f"block_size={block_size} is smaller than the MQAR sequences ({T} tokens): use "
         f"--block_size={T}")
    return meta, {split: load_tokens(data_dir, split, meta, least=T + 1) for split in ("train", "val")}, T


def draw_batch(tokens, meta, B, T, gen, train, copy_task=False):
    """B sequences drawn with the torch generator gen, (x, y) int64 numpy (B, T) each: random windows of tokens (y is x
    one token on); the copy task's random T/2-token chunk twice (y of the second half repeats the chunk); MQAR's
    whole sequences, fresh ones for training (seeded from gen, so a resumed run draws the same) and the stored ones
    for val, whose targets are the answers only (-1 elsewhere)."""
    import torch
    if "mqar" in meta and train:  # fresh sequences, from a numpy Generator seeded by gen
        return mqar_batch(np.random.default_rng(torch.randint(2**62, (), generator=gen).item()), B, meta)
    if "mqar" in meta:
        starts = torch.randint(len(tokens) // T, (B,), generator=gen).numpy() * T
        x = np.stack([tokens[i:i + T] for i in starts]).astype(np.int64)             # (B, T)
        return x, mqar_targets(x, meta)
    if copy_task:  # every target of the second half repeats the token T/2 back
        starts = torch.randint(len(tokens) - T // 2, (B,), generator=gen).numpy()
        chunk = np.stack([tokens[i:i + T // 2] for i in starts]).astype(np.int64)     # (B, T/2)
        x = np.concatenate([chunk, chunk], 1)                                        # (B, T)
        return x, np.concatenate([x[:, 1:], np.full((B, 1), -1)], 1)                 # (B, T): the last has no target
    starts = torch.randint(len(tokens) - T, (B,), generator=gen).numpy()
    x = np.stack([tokens[i:i + T] for i in starts]).astype(np.int64)                 # (B, T)
    return x, np.stack([tokens[i + 1:i + 1 + T] for i in starts]).astype(np.int64)   # (B, T)


def task_metrics(logits, y, meta, copy_task=False):
    """A batch's measures beside its loss, for train.py's evals, summed over batches then divided by "n": MQAR's
    answer accuracy (acc), the copy task's loss on each half (first: targets 0 .. T/2-2 continue the chunk; second:
    from T/2-1 on they copy it). logits (B, T, vocab) and targets y (B, T), torch tensors."""
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
    """(encode, decode) for meta's tokenizer: "bytes" (UTF-8, vocab 256), "chars" (token i is meta["chars"][i]),
    "ids" (token ids written as decimal numbers: mqar) or a tiktoken encoding ("gpt2", vocab 50257). decode
    drops ids past the vocabulary: models pad vocab_size up to a multiple of 64, and those extra ids have no text.
    A tokenizer that does not load is one InputError line that names source, where meta comes from."""
    check_schema(meta, META, f"{source or 'the tokenizer'}: its meta", required=("vocab_size", "tokenizer"))
    name, n = meta["tokenizer"], meta["vocab_size"]
    if name == "bytes":
        return (lambda s: list(s.encode("utf-8")),
                lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"))
    if name == "chars":
        chars = meta["chars"]
        stoi = {c: i for i, c in enumerate(chars)}

        def encode(s):
            unknown = sorted(set(s) - stoi.keys())
            if unknown:
                raise InputError(f"characters {''.join(unknown)!r} are not in this dataset's vocabulary "
                                 f"of {len(chars)}")
            return [stoi[c] for c in s]
        return encode, lambda ids: "".join(chars[i] for i in ids if i < len(chars))
    if name == "ids":
        def encode(s):
            if not all(t.isascii() and t.isdigit() for t in s.split()):  # "²" is a digit to isdigit, not to int
                raise InputError(f"this dataset's tokens are numbers: write the prompt as e.g. '3 17 4', "
                                 f"not {s[:40]!r}")
            return [int(t) for t in s.split()]
        return encode, lambda ids: " ".join(str(i) for i in ids if i < n)
    try:
        enc = tiktoken_encoding(name)
    except InputError as e:
        raise InputError(f"{source}: {e}" if source else str(e)) from None
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"}),
            lambda ids: enc.decode([i for i in ids if i < n]))


def mqar_targets(x, meta):
    """Targets for MQAR sequences x, an integer numpy array (..., seq_len): at each
    query (a key in the second half) the value paired with it at the start, -1 (ignored)
    everywhere else."""
    P, half, o = meta["mqar"]["num_pairs"], meta["mqar"]["seq_len"] // 2, meta["mqar"].get("offset", 0)
    keys, values = x[..., o:o + 2 * P:2], x[..., o + 1:o + 2 * P:2]     # (..., P) each
    match = x[..., half:, None] == keys[..., None, :]                   # (..., T/2, P); filler 0 is no key
    y = np.full_like(x, -1)
    y[..., half:] = np.where(match.any(-1), (match * values[..., None, :]).sum(-1), -1)
    return y


def mqar_batch(rng, n, meta):
    """n fresh MQAR sequences drawn with the numpy Generator rng: (x, y), int64 (n, seq_len)
    each, y = mqar_targets(x, meta). train.py draws every training batch this way."""
    m, V = meta["mqar"], meta["vocab_size"]
    T, P, Q, K = m["seq_len"], m["num_pairs"], m["num_queries"], m["num_keys"]
    firsts = lambda lo, hi, k: rng.permuted(np.tile(np.arange(lo, hi), (n, 1)), axis=1)[:, :k]  # k distinct per row
    keys, values = firsts(1, K + 1, P), firsts(K + 1, V, P)             # (n, P) each
    x = np.zeros((n, T), np.int64)                                      # (n, T), filler 0
    o = m.get("offset", 0)
    x[:, o:o + 2 * P:2], x[:, o + 1:o + 2 * P:2] = keys, values
    if m.get("ordered"):  # pair i asked at T/2 + 2i: every answer exactly T/2 - 1 tokens back
        where = np.broadcast_to(T // 2 + 2 * np.arange(P), (n, P))      # (n, P) query positions
        asked = np.broadcast_to(np.arange(P), (n, P))                   # (n, P)
    else:
        where = firsts(T // 2, T, Q)                                    # (n, Q) query positions
        # a different pair per query while there are enough (Zoology asks each key once): a key
        # asked twice is a second, wrong place to copy its value from, and slows learning a lot
        asked = firsts(0, P, Q) if Q <= P else rng.integers(P, size=(n, Q))  # (n, Q) pair each query asks for
    np.put_along_axis(x, where, np.take_along_axis(keys, asked, 1), 1)
    return x, mqar_targets(x, meta)


# -----------------------------------------------------------------------------
# Tokenise and write

def tiktoken_names():
    """The tiktoken encodings that are known here (their rank tables may still need a download): [] without tiktoken."""
    try:
        import tiktoken
    except ImportError:
        return []
    return tiktoken.list_encoding_names()


def tiktoken_encoding(name):
    try:
        import tiktoken
    except ImportError:
        raise InputError(f"the {name} tokenizer needs tiktoken: pip install tiktoken") from None
    if name not in tiktoken.list_encoding_names():
        raise InputError(f"unknown tokenizer {name!r}: use bytes, chars or a tiktoken encoding "
                         f"({', '.join(tiktoken.list_encoding_names())})")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # offline first use: tiktoken downloads the rank table once, then caches it
        raise InputError(f"tiktoken could not load the {name!r} encoding ({type(e).__name__}: {str(e)[:200]}); "
                         "it downloads once and caches: go online once, or set TIKTOKEN_CACHE_DIR to a cache") from None


def nearest_dir(path):
    """path, if it is a directory, else the nearest directory above it, where makedirs would create it."""
    d = os.path.abspath(path or ".")
    while not os.path.isdir(d):
        if os.path.exists(d):
            raise InputError(f"{d} is a file, not a directory: choose another path")
        d = os.path.dirname(d)
    return d


def check_writable(directory):
    """A one-line ValueError unless a file can be created in directory (if it does not exist
    yet, in nearest_dir(directory)): before a long run."""
    d = nearest_dir(directory)
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError as e:
        raise InputError(f"cannot write to {directory} ({e.strerror or e} in {d}): choose a writable path") from None


def check_output_file(key, path):
    """check_writable for the file that setting `key` names, which must not be a directory either."""
    if os.path.isdir(path):
        raise InputError(f"{key}={path!r} is a directory: give a file's path")
    check_writable(os.path.dirname(path))


def progress(iterable, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:
        print("(pip install tqdm for a progress bar)")
        return iterable
    return tqdm(iterable, **kwargs)


def pyplot(purpose):
    """matplotlib.pyplot, drawing to files only, for the scripts' plots; InputError if it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise InputError(f"{purpose} needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def text_tokenizer(name, text=None):
    """For writing: (meta fields, encode_batch: list of str or bytes -> list of id arrays, eot id or None).
    "chars" builds its vocabulary from `text`."""
    if name == "bytes":
        enc = lambda d: np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), np.uint8)
        return {"tokenizer": "bytes", "vocab_size": 256}, lambda docs: [enc(d) for d in docs], None
    if name == "chars":
        chars = sorted(set(text))
        lut = {c: i for i, c in enumerate(chars)}
        return ({"tokenizer": "chars", "vocab_size": len(chars), "chars": "".join(chars)},
                lambda docs: [np.array([lut[c] for c in d]) for d in docs], None)
    enc = tiktoken_encoding(name)
    return ({"tokenizer": name, "vocab_size": enc.n_vocab},
            lambda docs: enc.encode_ordinary_batch(list(docs), num_threads=os.cpu_count() or 1), enc.eot_token)


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 65535 else np.uint32


@contextlib.contextmanager
def removed_on_failure(paths):
    """Remove the files at paths if the block fails (a full disk, Ctrl-C): no partial file stays behind."""
    try:
        yield
    except BaseException:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)
        raise


def commit_dataset(data_dir, meta):
    """Move each split's <split>.bin.tmp into place, then write meta.json; an empty split
    stops it first, so an existing dataset is never replaced by an empty one. The old
    meta.json goes first: until the new one is written, the dataset reads as incomplete.
    A failed write never gets here: removed_on_failure deletes the .tmp files."""
    tmps = [os.path.join(data_dir, f"{split}.bin.tmp") for split in meta["tokens"]]
    empty = [split for split, n in meta["tokens"].items() if n == 0]
    if empty:
        for tmp in tmps:
            os.remove(tmp)
        raise InputError(f"the {' and '.join(empty)} split of {data_dir} would be empty: nothing written")
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        os.remove(os.path.join(data_dir, "meta.json"))
    for tmp in tmps:
        os.replace(tmp, tmp[:-len(".tmp")])
    return write_meta(data_dir, meta)


def write_meta(data_dir, meta):
    """Write meta.json, which load_meta will accept (META): an InputError, and nothing written, otherwise."""
    path = os.path.join(data_dir, "meta.json")
    need(schema_problem(meta, META) is None, f"{path} would be refused: {schema_problem(meta, META)}")
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(path + ".tmp", path)
    counts = ", ".join(f"{n:,} {split}" for split, n in meta["tokens"].items())
    print(f"wrote {data_dir}: {counts} tokens, vocab {meta['vocab_size']} ({meta['tokenizer']}), {meta['dtype']}")
    return meta


def write_dataset(data_dir, splits, tok, source, batch_docs=1024, **extra):
    """Tokenise each split's documents (an iterable of str or bytes) in batches with tok = text_tokenizer(...),
    append them to <split>.bin, a flat array of token ids (uint16, or uint32 past 65535 ids) with the end-of-text
    token after each document where the tokenizer has one, then write meta.json: {"vocab_size", "tokenizer",
    "dtype", "source", "tokens": {split: count}, "eot", ...}, mqar's adding "mqar"."""
    fields, encode_batch, eot = tok
    dtype = token_dtype(fields["vocab_size"])
    os.makedirs(data_dir, exist_ok=True)
    counts = {}
    with removed_on_failure([os.path.join(data_dir, f"{split}.bin.tmp") for split in splits]):
        for split, docs in splits.items():
            n = 0
            with open(os.path.join(data_dir, f"{split}.bin.tmp"), "wb") as f:
                batch = []
                for doc in progress(docs, desc=split, unit=" docs", mininterval=2):
                    batch.append(doc)
                    if len(batch) == batch_docs:
                        n += write_batch(f, encode_batch(batch), eot, dtype)
                        batch = []
                n += write_batch(f, encode_batch(batch), eot, dtype) if batch else 0
            counts[split] = n
    return commit_dataset(data_dir, {**fields, "dtype": np.dtype(dtype).name, "source": source,
                                     "tokens": counts, "eot": eot, **extra})


def write_batch(f, ids, eot, dtype):
    arrays = [np.asarray(a, dtype) for a in ids]
    if eot is not None:
        arrays = [x for a in arrays for x in (a, np.array([eot], dtype))]
    arr = np.concatenate(arrays) if arrays else np.zeros(0, dtype)
    f.write(arr.tobytes())
    return len(arr)


def split_text(text, frac):
    """The last `frac` of the text is val (nanoGPT's shakespeare split)."""
    cut = int(len(text) * (1 - frac))
    return {"train": [text[:cut]], "val": [text[cut:]]}


# -----------------------------------------------------------------------------
# Datasets

def prepare_text(data_dir, path, tokenizer_name, frac):
    """Any local text file, split like shakespeare_char."""
    if not os.path.isfile(path):
        raise InputError(f"--input_file={path}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw if tokenizer_name == "bytes" else raw.decode("utf-8")  # bytes stay exact
    except UnicodeDecodeError as e:
        raise InputError(f"--input_file={path} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}): "
                         f"use --tokenizer=bytes for binary files") from None
    if not text:
        raise InputError(f"--input_file={path} is empty")
    splits = split_text(text, frac)
    if not all(docs[0] for docs in splits.values()):
        raise InputError(f"--input_file={path} is too short to split into train and val with val_fraction={frac}")
    return write_dataset(data_dir, splits, text_tokenizer(tokenizer_name, text), source=path)


def pystdlib_files(root):
    """The *.py files under root, in sorted order, skipping the test packages and site-packages."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinks
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: site-packages can be huge
        files += [pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def prepare_pystdlib(data_dir, frac, root=None):
    """The running Python's standard library, byte-level. Split by file: file i is in val when
    floor((i+1) * frac) > floor(i * frac), which spreads val evenly over the sorted list."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = pystdlib_files(root)
    if not files:
        raise InputError(f"no *.py files found under {root}: build pystdlib on a Python with its standard library "
                         "sources")
    is_val = [int((i + 1) * frac) > int(i * frac) for i in range(len(files))]
    splits = {s: [p.read_bytes() for p, v in zip(files, is_val) if v == (s == "val")] for s in ("train", "val")}
    return write_dataset(data_dir, splits, text_tokenizer("bytes"), batch_docs=64,
                         source=f"pystdlib: {len(files)} *.py files of Python {sys.version.split()[0]} under {root}",
                         files={"train": is_val.count(False), "val": is_val.count(True)})


def mqar_layout(seq_len, num_pairs, num_queries, vocab, ordered=False, offset=0):
    """(num_keys, min_gap) of an MQAR layout (prepare_mqar's), or an InputError naming the rule it breaks."""
    K = (vocab - 1) // 2
    min_gap = seq_len // 2 - (2 * num_pairs - 1) - offset
    if not (1 <= num_pairs <= K and 1 <= num_queries <= seq_len - seq_len // 2 and min_gap + offset >= 1):
        raise InputError(f"mqar needs 1 <= num_pairs ({num_pairs}) <= (vocab-1)//2 ({K}), "
                         f"1 <= num_queries ({num_queries}) <= seq_len - seq_len // 2 and "
                         f"seq_len ({seq_len}) > 4 * num_pairs")
    if not 0 <= offset <= seq_len // 2 - 2 * num_pairs:  # the pairs end before the queries' half
        raise InputError(f"mqar needs 0 <= mqar_offset ({offset}) <= seq_len // 2 - 2 * num_pairs "
                         f"({seq_len // 2 - 2 * num_pairs})")
    if ordered and (num_queries != num_pairs or 4 * num_pairs > seq_len):
        raise InputError(f"mqar_ordered asks each pair once: it needs num_queries = num_pairs ({num_pairs}) "
                         f"and seq_len ({seq_len}) >= 4 * num_pairs")
    return K, seq_len // 2 - 1 - offset if ordered else min_gap


def prepare_mqar(data_dir, seq_len, num_pairs, num_queries, vocab, train_seqs, val_seqs, seed, ordered=False, offset=0):
    """Multi-query associative recall, Zoology's layout (Arora et al. 2023). Each sequence of
    seq_len tokens is

        k1 v1 k2 v2 ... kP vP  0 0 ... 0  |  0 q 0 0 q q 0 ... q 0   (| = seq_len // 2)

    P distinct keys from [1, K] with P distinct values from [K+1, vocab), filler 0, and in
    the second half num_queries keys at random positions, each asking for a different pair
    (at random if num_queries > P); the values never reappear. ordered=True asks every pair once, in order, at
    positions seq_len // 2 + 2i (a query, then filler): each answer is then exactly
    seq_len // 2 - 1 tokens back, so position alone finds it, as in a copy task, and the
    task tests reach, not content matching. The target at each query is its value, and only
    those are scored (mqar_targets). Every query is at least min_gap = seq_len // 2 - (2P - 1)
    tokens after the value it asks for, so an SWA model of n_layer layers and window w,
    whose reach is n_layer * (w - 1) tokens, can only guess when that reach is < min_gap.
    train.bin holds a sample (train.py draws fresh sequences with mqar_batch); val.bin
    is the fixed val set, from its own seed stream. offset > 0 starts the pairs at that token
    (filler before them), and min_gap shrinks by as much. Sets that memory or the disk cannot hold stop
    before anything is drawn."""
    K, min_gap = mqar_layout(seq_len, num_pairs, num_queries, vocab, ordered, offset)
    n, key = max((train_seqs, "mqar_train_seqs"), (val_seqs, "mqar_val_seqs"))
    ram = n * (8 * (2 * vocab + 3 * seq_len + seq_len * num_pairs // 2) + seq_len * num_pairs // 2)  # mqar_batch's
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # arrays, measured: within 1.6x of this
    need(ram <= have, f"{key}={n}: drawing {n:,} sequences of {seq_len} tokens (vocab {vocab:,}) takes about "
         f"{ram / 2**30:,.0f} GiB of memory; this machine has {have / 2**30:,.0f} GiB: use fewer (train.py draws "
         "fresh ones every batch), or a smaller mqar_vocab")
    tokens = (train_seqs + val_seqs) * seq_len
    disk, where = tokens * np.dtype(token_dtype(vocab)).itemsize, nearest_dir(data_dir)
    need(disk <= shutil.disk_usage(where).free, f"mqar_train_seqs={train_seqs}, mqar_val_seqs={val_seqs}: their "
         f"{tokens:,} tokens take {disk / 2**20:,.0f} MiB on disk, but {where} has "
         f"{shutil.disk_usage(where).free / 2**20:,.0f} MiB free: use fewer")
    os.makedirs(data_dir, exist_ok=True)
    mqar = dict(seq_len=seq_len, num_pairs=num_pairs, num_queries=num_queries, num_keys=K, min_gap=min_gap, seed=seed,
                ordered=ordered, offset=offset)
    meta = {"vocab_size": vocab, "tokenizer": "ids", "dtype": np.dtype(token_dtype(vocab)).name,
            "source": f"synthetic MQAR, seed {seed}", "tokens": {}, "eot": None, "mqar": mqar}
    with removed_on_failure([os.path.join(data_dir, f"{split}.bin.tmp") for split in ("train", "val")]):
        for split, n, rng in zip(("train", "val"), (train_seqs, val_seqs), np.random.default_rng(seed).spawn(2)):
            x, _ = mqar_batch(rng, n, meta)                             # (n, seq_len)
            x.astype(token_dtype(vocab)).tofile(os.path.join(data_dir, f"{split}.bin.tmp"))
            meta["tokens"][split] = x.size
    return commit_dataset(data_dir, meta)


def download_text(url):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            chunks = list(progress(iter(lambda: r.read(1 << 16), b""), desc="download", unit=" chunks"))
    except (urllib.error.URLError, OSError) as e:
        raise InputError(f"could not download {url} ({getattr(e, 'reason', e)}); offline? fetch it by hand, then "
                         "`python prepare_data.py --input_file=FILE --dataset=NAME --tokenizer=chars`") from None
    return b"".join(chunks).decode("utf-8")


def hf_dataset(path, name, split, streaming=False):
    """datasets.load_dataset, with one-line errors when the package or the network is missing."""
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path} is loaded with the `datasets` package: pip install datasets") from None
    try:
        return datasets.load_dataset(path, name, split=split, streaming=streaming)
    except Exception as e:  # offline shows up as several exception types, depending on the cache state
        first = (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"could not load {path} ({type(e).__name__}: {first}); check the network, "
                         "or set HF_DATASETS_OFFLINE=1 to use a copy already in the Hugging Face cache") from None


def prepare_shakespeare_char(data_dir, frac):
    text = download_text(SHAKESPEARE_URL)
    return write_dataset(data_dir, split_text(text, frac), text_tokenizer("chars", text), source=SHAKESPEARE_URL)


def prepare_fineweb_edu(data_dir, max_docs, val_docs):
    """FineWeb-Edu's sample-10BT, streamed: the first val_docs documents are val, the rest train."""
    import itertools
    stream = hf_dataset("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", streaming=True)
    texts = (row["text"] for row in (itertools.islice(stream, max_docs) if max_docs else stream))
    val = [next(texts) for _ in range(val_docs)]  # a stream is read once: take val off its head
    return write_dataset(data_dir, {"val": val, "train": texts}, text_tokenizer("gpt2"),
                         source=f"HuggingFaceFW/fineweb-edu sample-10BT, first {val_docs} docs as val")


def prepare_wikitext_103(data_dir):
    """WikiText-103 (raw), its own train/validation/test splits. Rows are lines of the
    articles, so they are concatenated as they are, with no end-of-text between them."""
    splits = {ours: (row["text"] for row in hf_dataset("Salesforce/wikitext", "wikitext-103-raw-v1", theirs))
              for ours, theirs in (("train", "train"), ("val", "validation"), ("test", "test"))}
    fields, encode_batch, _ = text_tokenizer("gpt2")
    return write_dataset(data_dir, splits, (fields, encode_batch, None),
                         source="Salesforce/wikitext wikitext-103-raw-v1")


def adopt_nanogpt(data_dir, tokenizer_name):
    """meta.json for nanoGPT's train.bin/val.bin (uint16 token ids) already in data_dir."""
    if tokenizer_name == "chars":
        raise InputError("tokenizer='chars': --adopt needs a tokenizer with a fixed vocabulary (bytes or a tiktoken "
                         "encoding such as gpt2); chars takes its vocabulary from the text")
    fields, _, eot = text_tokenizer(tokenizer_name)
    counts = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.isfile(path) or os.path.getsize(path) % 2:
            raise InputError(f"{path} is missing or not a uint16 token file")
        counts[split] = os.path.getsize(path) // 2
    meta = {**fields, "dtype": "uint16", "source": f"adopted nanoGPT data in {data_dir}", "tokens": counts, "eot": eot}
    for split in ("train", "val"):  # every id within the tokenizer's vocabulary, before a meta.json says so
        load_tokens(data_dir, split, meta)
    return write_meta(data_dir, meta)


if __name__ == "__main__":
    exec(open("configurator.py").read())  # every setting's type and range (guards.SETTINGS)
    data_dir = dataset_dir(data_root, dataset or (pathlib.Path(input_file).stem if input_file else "pystdlib"))
    name = os.path.basename(data_dir)
    try:  # an InputError is one line (guards.one_line); so is a read-only or full disk, which leaves the old data whole
        if adopt:
            adopt_nanogpt(data_dir, tokenizer)
        elif input_file:
            prepare_text(data_dir, input_file, tokenizer, val_fraction)
        elif name == "pystdlib":
            prepare_pystdlib(data_dir, val_fraction)
        elif name == "mqar":
            prepare_mqar(data_dir, mqar_seq_len, mqar_num_pairs, mqar_num_queries, mqar_vocab,
                         mqar_train_seqs, mqar_val_seqs, mqar_seed, mqar_ordered, mqar_offset)
        elif name == "shakespeare_char":
            prepare_shakespeare_char(data_dir, val_fraction)
        elif name == "fineweb-edu":
            prepare_fineweb_edu(data_dir, hf_max_docs, hf_val_docs)
        elif name == "wikitext-103":
            prepare_wikitext_103(data_dir)
        else:
            raise InputError(f"unknown dataset {name!r}: choose {', '.join(DATASETS)}, "
                             "or turn a text file into one with --input_file=FILE")
    except OSError as e:
        sys.exit(f"cannot write {e.filename or data_dir}: {e.strerror or e}")
