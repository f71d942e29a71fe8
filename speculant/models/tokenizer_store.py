"""A BPE ``tokenizer.json`` kept as arrays: the ``tokenizers.Tokenizer`` built from them in less memory than
parsing the file takes.

The ``tokenizers`` library parses a whole ``tokenizer.json`` through an intermediate tree of its JSON before it
builds the model, several times the file's size for a 262k-token vocabulary (Gemma 3's; the figures before and
after are in BENCHMARKS.md BC).  The file is read once (Python's
``json``), its vocabulary and merges are saved as arrays (:func:`write`: the tokens' UTF-8 bytes and offsets in the
file's order, their ids, each merge as its two parts' places in that order) beside
the rest of the file (the pipeline, the added tokens), and a load (:func:`load`) builds the tokenizer from the
pipeline with an empty model, then sets the BPE model made from the arrays (``tokenizers.models.BPE(vocab, merges,
...)``, the merges' order their rank as in the file).  The added tokens' ids are fixed before the model is set: the
empty model's vocabulary holds exactly them, at the file's ids, which is what ``tokenizers`` assigns when it reads the
file whole (an added token takes the model's id for its content, else the next free one) wherever the copy is made:
a file whose ids differ from those is not copied (:func:`write`).

The copy lives under ``$SPECULANT_CACHE/tokenizers``, keyed by the file's resolved path, size and modification time.
:func:`open_tokenizer` is the entry point: the copy when there is one, else written first (for a BPE model whose
merges' parts are tokens of its vocabulary), else the file parsed by ``tokenizers`` itself.
``tests/test_tokenizer_store.py`` compares the two tokenizers' serializations and encodings.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..paths import cache_root

FORMAT = 1
"""Version of the arrays' layout; a new one writes new copies."""
BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
               "ignore_merges")
"""The BPE model's settings in ``tokenizer.json`` beside ``vocab`` and ``merges``, each an argument of
``tokenizers.models.BPE``; a model with any other key is not copied."""


def copy_dir(tokenizer_json: Path) -> Path:
    """Where the arrays of ``tokenizer_json`` live: keyed by :data:`FORMAT` and the file's resolved path, device,
    inode, size, modification and status-change times (a changed file gets a new copy, also one replaced by a file of
    the same size with its old modification time restored: its inode or change time differ).

    Raises:
        OSError: the file cannot be read (``stat``).
    """
    path = Path(tokenizer_json).resolve()
    st = path.stat()
    stamp = (FORMAT, path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    key = hashlib.sha256("\0".join(map(str, stamp)).encode()).hexdigest()[:20]
    return cache_root() / "tokenizers" / key


def _merge_parts(merge, position: dict) -> tuple[int, int] | None:
    """The two parts' positions in the file's vocabulary (``position``: token -> its place in the file's order) of
    one merge of the file (``[a, b]``, or the older ``"a b"``), ``None`` when it has not exactly two parts that are
    tokens of the vocabulary."""
    parts = merge.split(" ") if isinstance(merge, str) else merge
    if not isinstance(parts, list) or len(parts) != 2:
        return None
    a, b = position.get(parts[0]), position.get(parts[1])
    return None if a is None or b is None else (a, b)


def _added_ids_as_read(vocab: dict, added: list) -> bool:
    """Whether ``tokenizers`` reading the file gives each added token the id the file records (the copy fixes those
    ids before the model is set): a token of the vocabulary takes the vocabulary's id, the others the next ids after
    the vocabulary, in the file's order; with the vocabulary's ids ``0 .. n-1`` (no gap for a new id to follow)."""
    n = len(vocab)
    if any(not isinstance(i, int) or not 0 <= i < n for i in vocab.values()) or len(set(vocab.values())) != n:
        return False
    following = n
    for token in added:
        if not isinstance(token, dict) or not isinstance(token.get("content"), str):
            return False
        known = vocab.get(token["content"])
        if known is None:
            if token.get("id") != following:
                return False
            following += 1
        elif token.get("id") != known:
            return False
    return True


def write(tokenizer_json: Path) -> Path | None:
    """Save the arrays of ``tokenizer_json`` (see the module docstring) in :func:`copy_dir`, written in a temporary
    directory renamed into place.  Returns the directory, or ``None`` where the file's model is not a BPE model this
    copy reproduces (another type, a setting outside :data:`BPE_OPTIONS`, a merge whose parts are not tokens of the
    vocabulary, ids with gaps or added tokens at ids ``tokenizers`` would not give them) or the file is not valid
    JSON (``tokenizers`` then says what is wrong).

    Raises:
        OSError: the file cannot be read or the cache cannot be written.
    """
    out = copy_dir(tokenizer_json)
    try:
        data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    if (not isinstance(model, dict) or model.get("type") != "BPE" or set(model) - {"type", "vocab", "merges",
                                                                                     *BPE_OPTIONS}):
        return None
    vocab, merges, added = model.get("vocab"), model.get("merges"), data.get("added_tokens") or []
    if (not isinstance(vocab, dict) or not isinstance(merges, list) or not isinstance(added, list)
            or not _added_ids_as_read(vocab, added)):
        return None
    position = {t: i for i, t in enumerate(vocab)}
    pairs = np.empty((len(merges), 2), dtype=np.int32)
    for i, merge in enumerate(merges):
        ids = _merge_parts(merge, position)
        if ids is None:
            return None
        pairs[i] = ids
    del merges, position
    tokens = [t.encode("utf-8") for t in vocab]
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    arrays = {"bytes": np.frombuffer(b"".join(tokens), dtype=np.uint8), "offsets": offsets,
              "ids": np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab)), "merges": pairs}
    del tokens
    # the pipeline: the file without its vocabulary and merges; the empty model's vocabulary holds the added tokens
    # at their ids, so that reading it assigns each added token the id the file records
    data["model"] = dict(model, vocab={t["content"]: t["id"] for t in added}, merges=[])
    meta = {"source": str(Path(tokenizer_json).resolve()), "vocab_size": len(vocab),
            "added": {t["content"]: t["id"] for t in added}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        np.savez(tmp / "vocab.npz", **arrays)
        (tmp / "pipeline.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        (tmp / "meta.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)                  # an incomplete leftover, or the same copy from another process
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load(tokenizer_json: Path):
    """The ``tokenizers.Tokenizer`` of ``tokenizer_json`` built from its arrays (:func:`write`), or ``None`` when
    there is no complete copy, or the tokenizer built does not hold the file's vocabulary size and added tokens at
    their ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    where = copy_dir(tokenizer_json)
    try:
        meta = json.loads((where / "meta.json").read_text(encoding="utf-8"))
        pipeline = (where / "pipeline.json").read_text(encoding="utf-8")
        with np.load(where / "vocab.npz") as arrays:
            blob, offsets = arrays["bytes"].tobytes(), arrays["offsets"]
            ids, pairs = arrays["ids"].tolist(), arrays["merges"]
    except (OSError, ValueError, KeyError):
        return None
    tokenizer = Tokenizer.from_str(pipeline)
    options = {k: v for k, v in json.loads(tokenizer.model.__getstate__()).items()
               if k in BPE_OPTIONS and v is not None}      # None: the constructor's default (the same)
    starts = offsets.tolist()
    tokens = [blob[starts[i]:starts[i + 1]].decode("utf-8") for i in range(len(ids))]
    del blob, starts
    vocab = dict(zip(tokens, ids))
    merges = [(tokens[i], tokens[j]) for i, j in zip(pairs[:, 0].tolist(), pairs[:, 1].tolist())]
    del tokens, ids
    try:
        tokenizer.model = BPE(vocab=vocab, merges=merges, **options)
    except Exception:              # noqa: BLE001 - a merged token outside the vocabulary: the file's own error then
        return None
    del vocab, merges
    if tokenizer.get_vocab_size(with_added_tokens=False) != meta["vocab_size"]:
        return None
    if any(tokenizer.token_to_id(content) != i for content, i in meta["added"].items()):
        return None
    return tokenizer


def open_tokenizer(tokenizer_json: Path):
    """The ``tokenizers.Tokenizer`` of ``tokenizer_json``: from its arrays (:func:`load`; written first by
    :func:`write` when missing), else parsed whole by ``tokenizers`` (a model the arrays do not reproduce, an
    unwritable cache).

    Raises:
        Exception: what ``tokenizers`` raises for a missing or bad file.
    """
    from tokenizers import Tokenizer

    tokenizer_json = Path(tokenizer_json)
    try:
        tokenizer = load(tokenizer_json)
        if tokenizer is None and write(tokenizer_json) is not None:
            tokenizer = load(tokenizer_json)
    except OSError:
        tokenizer = None
    return tokenizer if tokenizer is not None else Tokenizer.from_file(str(tokenizer_json))
