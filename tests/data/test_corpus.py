import hashlib
import json
import os
import sysconfig
import warnings

import pytest

from k3.data.corpus import LINES_PER_BLOCK, load_corpus, stdlib_corpus


def _val_by_formula(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest(), 16) % 100 < 2


def test_stdlib_corpus_split_follows_sha256_rule_and_excludes_site_packages():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = load_corpus()
    root = sysconfig.get_paths()["stdlib"]
    expected = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        expected += [os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                     for f in files if f.endswith(".py")]
    expected = sorted(expected)
    got = c.train_ids + c.validation_ids
    assert sorted(got) == expected
    assert c.train_ids == sorted(c.train_ids) and c.validation_ids == sorted(c.validation_ids)
    assert all(_val_by_formula(i) for i in c.validation_ids)
    assert not any(_val_by_formula(i) for i in c.train_ids)
    assert c.validation_ids, "2% of ~1800 stdlib files must give a validation split"
    assert c.val_bytes == sum(len(t.encode()) for t in c.documents("validation"))


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_non_utf8_bytes_are_replaced_counted_and_reported_not_the_file_dropped(tmp_path):
    _write(tmp_path / "a.py", b"x = 1\n")
    _write(tmp_path / "pkg" / "b.py", b"y = 2\n")
    # one bad byte in a valid file, and a 3-byte run of invalid bytes (no valid sequence inside)
    _write(tmp_path / "latin.py", "caf\u00e9 = 3\n".encode("latin-1") + b"ok = 1\n")
    _write(tmp_path / "run.py", b"s = '\xff\xfe\xfd'\n")
    _write(tmp_path / "site-packages" / "c.py", b"z = 3\n")
    _write(tmp_path / "notes.txt", b"not python\n")
    with pytest.warns(UserWarning, match=r"replaced 4 invalid UTF-8 byte\(s\) by U\+FFFD in 2 file"):
        c = stdlib_corpus(tmp_path)
    assert c.replaced == {"latin.py": 1, "run.py": 3} and c.bad_bytes == 4
    assert sorted(c.train_ids + c.validation_ids) == ["a.py", "latin.py", "pkg/b.py", "run.py"]
    texts = dict(zip(c.train_ids + c.validation_ids, c.train_texts + c.validation_texts))
    assert texts["latin.py"] == "caf\ufffd = 3\nok = 1\n"   # the rest of the file is kept
    assert texts["run.py"] == "s = '\ufffd\ufffd\ufffd'\n"  # as bytes.decode(errors="replace")
    assert "4 invalid UTF-8 bytes in 2 files" in c.summary()
    # positive control: a clean directory reports nothing
    clean = tmp_path / "pkg"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c2 = load_corpus(clean)
    assert c2.replaced == {} and c2.bad_bytes == 0 and "invalid" not in c2.summary()


def test_directory_with_jsonl_and_text_files(tmp_path):
    _write(tmp_path / "d.jsonl", "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(300))
           .encode())
    _write(tmp_path / "sub" / "t.txt", b"plain text\n")
    _write(tmp_path / ".hidden", b"ignored\n")
    c = load_corpus(tmp_path)
    ids = c.train_ids + c.validation_ids
    assert sorted(ids) == sorted([f"d.jsonl:{i + 1}" for i in range(300)] + ["sub/t.txt"])
    assert all(_val_by_formula(i) for i in c.validation_ids)
    assert not any(_val_by_formula(i) for i in c.train_ids)
    texts = dict(zip(c.train_ids + c.validation_ids,
                     list(c.documents("train")) + list(c.documents("validation"))))
    assert texts["d.jsonl:5"] == "doc 4" and texts["sub/t.txt"] == "plain text\n"


def test_single_text_file_is_cut_into_line_blocks(tmp_path):
    lines = [f"line {i}\n" for i in range(LINES_PER_BLOCK * 40 + 7)]
    _write(tmp_path / "book.txt", "".join(lines).encode())
    c = load_corpus(tmp_path / "book.txt")
    assert len(c.train_ids) + len(c.validation_ids) == 41
    assert all(_val_by_formula(i) == (i in c.validation_ids) for i in c.train_ids)
    by_id = dict(zip(c.train_ids + c.validation_ids,
                     list(c.documents("train")) + list(c.documents("validation"))))
    assert "".join(by_id[f"book.txt:{b}"] for b in range(41)) == "".join(lines)


def test_missing_path_and_empty_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty")
    _write(tmp_path / "bad.jsonl", b'{"txt": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_corpus(tmp_path / "bad.jsonl")


def test_hf_dataset_dir_without_datasets_gives_clear_error(tmp_path):
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed")
    except ImportError:
        pass
    _write(tmp_path / "ds" / "dataset_dict.json", b'{"splits": ["train"]}')
    with pytest.raises(ImportError, match="datasets"):
        load_corpus(tmp_path / "ds")


def test_fingerprint_changes_with_content(tmp_path):
    _write(tmp_path / "a.txt", b"one\n")
    _write(tmp_path / "b.txt", b"two\n")
    f1 = load_corpus(tmp_path).fingerprint
    assert load_corpus(tmp_path).fingerprint == f1
    _write(tmp_path / "b.txt", b"two!\n")
    assert load_corpus(tmp_path).fingerprint != f1


class _FakeDatasets:
    """Just enough of the `datasets` API (load_from_disk, Dataset, DatasetDict) for the loader."""

    class Dataset(list):
        pass

    class DatasetDict(dict):
        pass

    def __init__(self, obj):
        self.obj = obj

    def load_from_disk(self, path):
        return self.obj


def _rows(texts):
    return _FakeDatasets.Dataset({"text": t} for t in texts)


def test_hf_dataset_dict_keeps_its_own_splits(tmp_path, monkeypatch):
    import sys
    dd = _FakeDatasets.DatasetDict(train=_rows(["a", "b", "c"]), validation=_rows(["v"]))
    monkeypatch.setitem(sys.modules, "datasets", _FakeDatasets(dd))
    _write(tmp_path / "ds" / "dataset_dict.json", b'{"splits": ["train", "validation"]}')
    c = load_corpus(tmp_path / "ds")
    assert list(c.documents("train")) == ["a", "b", "c"] and list(c.documents("validation")) == ["v"]
    assert c.train_ids == ["train/0", "train/1", "train/2"] and c.val_bytes == 1


def test_hf_plain_dataset_is_split_by_row_id_hash(tmp_path, monkeypatch):
    import sys
    texts = [f"row {i}" for i in range(400)]
    monkeypatch.setitem(sys.modules, "datasets", _FakeDatasets(_rows(texts)))
    _write(tmp_path / "ds" / "dataset_info.json", b"{}")
    c = load_corpus(tmp_path / "ds")
    assert c.validation_ids == [str(i) for i in range(400) if _val_by_formula(str(i))]
    assert len(c.train_ids) + len(c.validation_ids) == 400
