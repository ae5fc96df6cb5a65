"""Write the docs' generated tables from committed benchmark data (never typed in by hand).

Each table lives between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in a docs file and is
rendered from a JSON record under ``docs/data/`` that carries its machine and date:

- ``agent_demo`` (docs/POSTTRAINING.md) from ``docs/data/agent_demo.json``, the report of one
  ``k3 agent-demo`` run (``runs/agent-demo/report.json`` copied there by ``--save``).

    python benchmarks/docs_tables.py [--save runs/agent-demo/report.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "agent_demo.json"
DOC = ROOT / "docs" / "POSTTRAINING.md"


def agent_demo_table(report: dict) -> str:
    s, t = report["sft"], report["times"]
    head = ("| model | family (domain) | effort | held-out pass | well-formed turns |\n"
            "|---|---|---|---|---|")
    rows = [f"| {c['model']} | {c['family']} ({c['domain']}) | {c['effort']} | "
            f"{c['passed']}/{c['tasks']} ({100 * c['pass_rate']:.0f} %) | "
            f"{c['well_formed']}/{c['turns']} ({100 * c['well_formed_rate']:.0f} %) |" for c in report["cells"]]
    sft = [c for c in report["cells"] if c["model"] == "sft"]
    turns = sum(c["turns"] for c in sft)
    wf = sum(c["well_formed"] for c in sft) / max(turns, 1)
    times = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in t.items())
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`docs/data/agent_demo.json`).",
        f"SFT: {s['steps']} steps of {s['batch_size']} × {s['seq_len']} tokens, lr {s['lr']}, on "
        f"{s['train_conversations']:,} conversations ({s['trained_tokens']:,} trained tokens per epoch); "
        f"well-formed turns over all SFT cells: {100 * wf:.1f} %. Times: {times}.",
        "", head, *rows])


def replace_block(doc: Path, name: str, body: str) -> None:
    text = doc.read_text()
    pat = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"{doc}: no <!-- {name}:begin --> ... <!-- {name}:end --> markers")
    doc.write_text(pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", help="a k3 agent-demo report.json to record as docs/data/agent_demo.json first")
    a = p.parse_args()
    if a.save:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(a.save, DATA)
    replace_block(DOC, "agent_demo", agent_demo_table(json.loads(DATA.read_text())))
    print(f"wrote the agent_demo table of {DOC.relative_to(ROOT)} from {DATA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
