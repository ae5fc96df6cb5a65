"""Training corpora: the Python standard library by default, or local text / JSONL / HF datasets.

Every source becomes a list of documents, each with a stable string id, split into training and
validation by one rule applied to the id:

    validation  ⇔  int(sha256(id.encode("utf-8")).hexdigest(), 16) % 100 < val_percent   (default 2)

Document ids per source (the split is a pure function of them, so adding a file never moves
another one between splits):

* default corpus: ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` minus anything below a
  ``site-packages`` / ``dist-packages`` folder; id = the path relative to that root, posix
  separators; sorted by id.
* ``--data DIR``: every regular file below DIR (hidden files and folders skipped), sorted by
  relative path; id = relative path. ``*.jsonl`` files contribute one document per line (field
  ``"text"``) with id ``"<relpath>:<line number from 1>"``; other files are one document each.
* ``--data FILE.jsonl``: as above, relpath = the file name.
* ``--data FILE`` (any other file): cut into blocks of ``LINES_PER_BLOCK`` lines, id
  ``"<file name>:<block index>"`` — a single file would otherwise land wholly in one split.
* ``--data DIR`` saved by HF ``datasets.save_to_disk``: a ``DatasetDict`` with a ``train`` split
  and a ``validation`` (else ``test``) split is used as split; otherwise every row, id
  ``"<split>/<row index>"`` (or ``"<row index>"`` for a plain ``Dataset``), goes through the rule.

If the rule leaves the validation split empty while there are at least two documents, the first
document (in id order) with the smallest ``hash % 100`` is moved to validation (deterministic; small
corpora still get a validation loss). Bytes that are not valid UTF-8 are decoded as U+FFFD (one
per invalid sequence, as ``errors="replace"``), never dropping a file; the count of bad bytes per
document is kept in ``Corpus.replaced`` and reported in a warning and in ``summary()``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from k3.errors import K3Error

__all__ = ["Corpus", "load_corpus", "stdlib_corpus", "is_validation", "id_hash", "LINES_PER_BLOCK"]

LINES_PER_BLOCK = 200
_EXCLUDED_DIRS = ("site-packages", "dist-packages")


def id_hash(doc_id: str) -> int:
    """The split hash: sha256 of the utf-8 id, read as one big integer."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest(), 16)


def is_validation(doc_id: str, val_percent: int = 2) -> bool:
    return id_hash(doc_id) % 100 < val_percent


@dataclass
class Corpus:
    """Documents of both splits in a stable order, plus what was replaced while reading."""

    name: str
    train_ids: list[str]
    train_texts: list[str]
    validation_ids: list[str]
    validation_texts: list[str]
    replaced: dict[str, int] = field(default_factory=dict)  # file id -> invalid UTF-8 bytes replaced
    _fingerprint: str | None = field(default=None, repr=False)

    def documents(self, split: str = "train") -> Iterator[str]:
        """The documents of ``split`` ("train" or "validation") as str, in stable order."""
        if split == "train":
            return iter(self.train_texts)
        if split in ("validation", "val"):
            return iter(self.validation_texts)
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")

    def num_documents(self, split: str = "train") -> int:
        return len(self.train_texts if split == "train" else self.validation_texts)

    @property
    def val_bytes(self) -> int:
        """UTF-8 byte count of the validation text (the denominator of bits per byte)."""
        return sum(len(t.encode("utf-8")) for t in self.validation_texts)

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.train_texts)

    @property
    def fingerprint(self) -> str:
        """sha256 over ids and texts of both splits: changes whenever any document changes."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for split, ids, texts in (("train", self.train_ids, self.train_texts),
                                      ("validation", self.validation_ids, self.validation_texts)):
                h.update(split.encode())
                for i, t in zip(ids, texts):
                    b = t.encode("utf-8")
                    h.update(f"\0{i}\0{len(b)}\0".encode("utf-8"))
                    h.update(b)
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def doc_digests(self) -> dict[str, str]:
        """Document id -> sha256 of its UTF-8 text (first 16 hex digits), both splits."""
        return {i: hashlib.sha256(t.encode("utf-8")).hexdigest()[:16]
                for i, t in zip(self.train_ids + self.validation_ids, self.train_texts + self.validation_texts)}

    @property
    def bad_bytes(self) -> int:
        """Invalid UTF-8 bytes replaced by U+FFFD while reading, over all files."""
        return sum(self.replaced.values())

    def summary(self) -> str:
        bad = (f"; {self.bad_bytes:,} invalid UTF-8 bytes in {len(self.replaced)} files replaced by U+FFFD"
               if self.replaced else "")
        return (f"corpus {self.name}: {len(self.train_texts)} train docs ({self.train_bytes:,} B), "
                f"{len(self.validation_texts)} validation docs ({self.val_bytes:,} B){bad}")


# ------------------------------------------------------------------------- building a corpus
def _split(name: str, docs: list[tuple[str, str]], replaced: dict[str, int], val_percent: int) -> Corpus:
    if not docs:
        raise K3Error(f"corpus {name} is empty (no documents)")
    is_val = [is_validation(i, val_percent) for i, _ in docs]
    if not any(is_val) and len(docs) >= 2:
        is_val[min(range(len(docs)), key=lambda k: id_hash(docs[k][0]) % 100)] = True
    tr = [d for d, v in zip(docs, is_val) if not v]
    va = [d for d, v in zip(docs, is_val) if v]
    return Corpus(name, [i for i, _ in tr], [t for _, t in tr], [i for i, _ in va],
                  [t for _, t in va], replaced)


def _read_utf8(path: Path, doc_id: str, replaced: dict[str, int]) -> str:
    """The file as str; each maximal invalid UTF-8 sequence becomes one U+FFFD
    (``errors="replace"``) and the number of invalid bytes is stored in ``replaced[doc_id]``."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    # surrogateescape maps each invalid byte to one lone surrogate U+DC80..U+DCFF: count those
    replaced[doc_id] = len(_ESCAPED.findall(raw.decode("utf-8", "surrogateescape")))
    return raw.decode("utf-8", "replace")


_ESCAPED = re.compile("[\udc80-\udcff]")


def _warn_replaced(name: str, replaced: dict[str, int]) -> None:
    if replaced:
        ids = list(replaced)
        head = ", ".join(f"{i} ({replaced[i]})" for i in ids[:3]) + (", ..." if len(ids) > 3 else "")
        warnings.warn(f"{name}: replaced {sum(replaced.values()):,} invalid UTF-8 byte(s) by U+FFFD "
                      f"in {len(ids)} file(s): {head}", stacklevel=3)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(root: str | os.PathLike | None = None, val_percent: int = 2) -> Corpus:
    """The default corpus: ``*.py`` of the running interpreter's stdlib (``root`` overrides it)."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root}")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    rel = sorted((p.relative_to(root).as_posix(), p) for p in paths if p.is_file())
    docs, replaced = [], {}
    for doc_id, p in rel:
        docs.append((doc_id, _read_utf8(p, doc_id, replaced)))
    _warn_replaced(f"stdlib {root}", replaced)
    return _split(f"stdlib:{root}", docs, replaced, val_percent)


def _jsonl_docs(path: Path, rel: str, replaced: dict[str, int]) -> list[tuple[str, str]]:
    text = _read_utf8(path, rel, replaced)
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise K3Error(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise K3Error(f"{path}:{n}: a JSONL record needs a string field 'text'")
        docs.append((f"{rel}:{n}", rec["text"]))
    return docs


def _text_file_blocks(path: Path, replaced: dict[str, int]) -> list[tuple[str, str]]:
    text = _read_utf8(path, path.name, replaced)
    lines = text.splitlines(keepends=True)
    return [(f"{path.name}:{b}", "".join(lines[s:s + LINES_PER_BLOCK]))
            for b, s in enumerate(range(0, len(lines), LINES_PER_BLOCK))]


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file() \
        or (path / "state.json").is_file()


def _hf_corpus(path: Path, val_percent: int) -> Corpus:
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError:
        raise ImportError(f"{path} looks like a HF `datasets` directory (save_to_disk), but the "
                          "`datasets` package is not installed; `pip install datasets`, or pass "
                          "text/JSONL files instead") from None
    ds = datasets.load_from_disk(str(path))
    name = f"hf:{path}"
    if isinstance(ds, datasets.DatasetDict):
        val_name = "validation" if "validation" in ds else "test" if "test" in ds else None
        if "train" in ds and val_name is not None:
            tr = [(f"train/{k}", r["text"]) for k, r in enumerate(ds["train"])]
            va = [(f"{val_name}/{k}", r["text"]) for k, r in enumerate(ds[val_name])]
            if not tr:
                raise K3Error(f"corpus {name} is empty")
            return Corpus(name, [i for i, _ in tr], [t for _, t in tr],
                          [i for i, _ in va], [t for _, t in va])
        docs = [(f"{s}/{k}", r["text"]) for s in sorted(ds) for k, r in enumerate(ds[s])]
    else:
        docs = [(str(k), r["text"]) for k, r in enumerate(ds)]
    return _split(name, docs, [], val_percent)


def load_corpus(path: str | os.PathLike | None = None, val_percent: int = 2) -> Corpus:
    """Load the corpus at ``path`` (None → the stdlib corpus); see the module docstring.

    Raises FileNotFoundError naming a missing path, K3Error for an empty corpus.
    """
    if not 0 <= val_percent < 100:
        raise K3Error(f"val_percent must be in [0, 100), got {val_percent}")
    if path is None:
        return stdlib_corpus(val_percent=val_percent)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"corpus path not found: {p}")
    replaced: dict[str, int] = {}
    if p.is_file():
        docs = _jsonl_docs(p, p.name, replaced) if p.suffix == ".jsonl" else \
            _text_file_blocks(p, replaced)
    elif _is_hf_dataset_dir(p):
        return _hf_corpus(p, val_percent)
    else:
        docs = []
        for f in sorted(p.rglob("*"), key=lambda q: q.relative_to(p).as_posix()):
            rel = f.relative_to(p).as_posix()
            if not f.is_file() or any(part.startswith(".") for part in rel.split("/")):
                continue
            if f.suffix == ".jsonl":
                docs += _jsonl_docs(f, rel, replaced)
            else:
                docs.append((rel, _read_utf8(f, rel, replaced)))
    _warn_replaced(str(p), replaced)
    return _split(str(p), docs, replaced, val_percent)
