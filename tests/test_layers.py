"""The package's import graph is acyclic and follows the layer order (SPEC §1): a module imports
only from its own layer or from layers below it.

    config → ops → model → checkpoint → data → train → infer → serve → env → tasks → agent
        → rl → cli

Every import counts, module-level or inside a function (a function-local import is still an
edge). ``k3.errors``, ``k3.version``, ``k3.fsutil``, ``k3.threads`` and ``k3.cliutil`` sit below
every layer and import none of them. The checker is tested on a small package with a cycle and a
back edge (the control that it can fail)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "k3"
ORDER = ["config", "ops", "model", "checkpoint", "data", "train", "infer", "serve", "env", "tasks", "agent", "rl",
         "cli"]
BASE = {"errors", "version", "fsutil", "threads", "cliutil"}


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> modules of the package it imports (``from a.b import c`` counts ``a.b.c`` when that
    is a module, else ``a.b``; relative imports resolved)."""
    pkg_name = root.name
    mods: dict[str, Path] = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(".py"):
                p = Path(dp) / f
                rel = p.relative_to(root.parent).with_suffix("")
                mods[".".join(rel.parts).removesuffix(".__init__")] = p
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                if not (n == pkg_name or n.startswith(pkg_name + ".")):
                    continue
                while n not in mods and "." in n:
                    n = n.rsplit(".", 1)[0]
                if n in mods and n != m:
                    edges[m].add(n)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root), on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w), on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer(module: str) -> str | None:
    """The module's layer (``k3.infer.engine`` -> ``infer``); None for the package root and its
    ``__main__`` (the entry points, which may import anything)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def back_edges(edges: dict[str, set[str]], order: list[str], base: set[str]) -> list[str]:
    """Imports that go up the order (or from a base module into any layer, or from the package's
    top ``__init__`` nowhere: it may import anything)."""
    rank = {name: i for i, name in enumerate(order)}
    bad = []
    for a, targets in edges.items():
        la = layer(a)
        for b in targets:
            lb = layer(b)
            if la is None:            # the package root re-exports the public names
                continue
            if la in base and lb not in base:
                bad.append(f"{a} -> {b}")
            elif la in rank and lb in rank and rank[lb] > rank[la]:
                bad.append(f"{a} -> {b}")
            elif la in rank and lb is None:
                bad.append(f"{a} -> {b} (the package root imports every layer)")
    return sorted(bad)


def test_every_module_has_a_layer():
    mods = import_graph(SRC)
    loose = sorted(m for m in mods if layer(m) not in (None, *ORDER, *BASE))
    assert not loose, f"modules outside every layer (add them to one): {loose}"


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(SRC))
    assert not found, "import cycles:\n" + "\n".join(" ".join(c) for c in found)


def test_imports_follow_the_layer_order():
    bad = back_edges(import_graph(SRC), ORDER, BASE)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_checker_finds_a_cycle_and_a_back_edge(tmp_path):
    """The control: a package with model -> infer (a back edge) and a two-module cycle in infer."""
    pkg = tmp_path / "k3"
    for rel, text in {
        "__init__.py": "",
        "model/__init__.py": "",
        "model/decoder.py": "def generate():\n    from k3.infer.run import go\n    return go\n",
        "infer/__init__.py": "",
        "infer/run.py": "from k3.infer import engine\n\ndef go():\n    return engine\n",
        "infer/engine.py": "from .run import go\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    edges = import_graph(pkg)
    assert edges["k3.infer.run"] == {"k3.infer.engine"} and "k3.infer.run" in edges["k3.infer.engine"]
    assert cycles(edges) == [["k3.infer.engine", "k3.infer.run"]]
    assert back_edges(edges, ORDER, BASE) == ["k3.model.decoder -> k3.infer.run"]
    (pkg / "model/decoder.py").write_text("X = 1\n")                    # fixed: no edge up, no cycle left
    (pkg / "infer/run.py").write_text("def go():\n    return 1\n")
    edges = import_graph(pkg)
    assert cycles(edges) == [] and back_edges(edges, ORDER, BASE) == []
