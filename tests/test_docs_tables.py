"""The generated tables in README.md and docs/ are what ``benchmarks/docs_tables.py`` renders from
the committed data under docs/data/ (nobody edited a figure by hand, and no data changed without
its tables); an edited figure is caught (the control)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _tables()


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _blocks():
    """(doc, block name, its data file, the rendered table) for every block whose data is committed."""
    out = []
    if T.SPEED.exists():
        rows = _rows(T.SPEED)
        out += [(T.INFER_DOC, "speed_infer", T.SPEED, T.speed_infer_table(rows)),
                (T.README, "speed_infer", T.SPEED, T.speed_infer_table(rows)),
                (T.README, "speed_train", T.SPEED, T.speed_train_table(rows))]
    if T.DATA.exists():
        out.append((T.DOC, "agent_demo", T.DATA, T.agent_demo_table(json.loads(T.DATA.read_text()))))
    if T.RL_DATA.exists():
        out.append((T.RL_DOC, "rl_demo", T.RL_DATA, T.rl_demo_table(json.loads(T.RL_DATA.read_text()))))
    if T.EVAL_ROWS.exists():
        out.append((T.EVAL_DOC, "eval_harness", T.EVAL_ROWS, T.eval_harness_table(_rows(T.EVAL_ROWS))))
    if T.VISION_DATA.exists():
        out.append((T.VISION_DOC, "vision_demo", T.VISION_DATA,
                    T.vision_demo_table(json.loads(T.VISION_DATA.read_text()))))
    if T.HYBRID_DATA.exists():
        out.append((T.EVAL_DOC, "hybrid_retrieval", T.HYBRID_DATA,
                    T.hybrid_table(json.loads(T.HYBRID_DATA.read_text()))))
    return out


def _block(text: str, name: str) -> str | None:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    return None if m is None else m.group(1).rstrip("\n")


BLOCKS = _blocks()


@pytest.mark.parametrize("doc,name,data,rendered", BLOCKS,
                         ids=[f"{d.name}:{n}" for d, n, _, _ in BLOCKS])
def test_each_generated_table_is_what_its_data_renders(doc, name, data, rendered):
    got = _block(doc.read_text(), name)
    assert got is not None, f"{doc.name}: no <!-- {name}:begin/end --> block"
    assert got == rendered, (f"{doc.name}'s {name} table differs from {data.relative_to(ROOT)}: "
                             "run python benchmarks/docs_tables.py")


def test_an_edited_figure_is_caught(tmp_path):
    """The control: one digit changed inside a generated table no longer matches its data."""
    assert BLOCKS, "no generated tables with committed data"
    doc, name, _, rendered = BLOCKS[0]
    text = doc.read_text()
    block = _block(text, name)
    i = next(i for i, c in enumerate(block) if c.isdigit())
    edited = block[:i] + str((int(block[i]) + 1) % 10) + block[i + 1:]
    assert _block(text.replace(block, edited), name) != rendered
