"""The product's import graph, lazy imports included: its cycles and its imports against the
grain (`app` -> `autoscale` -> `replicas`, nothing the other way).

    python -m tests.support.import_graph

reads every module of the product's packages with `ast` (imports inside functions count: they
run too) and prints the cycles and the backward imports; tests/test_imports.py asserts none.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "autoscale", "replicas")  # in the order imports may flow


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module in the product's packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The product modules `path` imports, at module level or inside functions."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


def backward(g: dict[str, set[str]]) -> Iterator[tuple[str, str]]:
    """Imports from a package to one before it in PACKAGES (e.g. replicas -> autoscale)."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    for src, targets in sorted(g.items()):
        for dst in sorted(targets):
            if rank[dst.split(".")[0]] < rank[src.split(".")[0]]:
                yield src, dst


def main() -> int:
    g = graph()
    found, wrong = cycles(g), list(backward(g))
    print(f"{len(g)} modules, {sum(len(t) for t in g.values())} imports (lazy ones included)")
    print(f"cycles: {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    print(f"imports against app -> autoscale -> replicas: {len(wrong)}")
    for src, dst in wrong:
        print(f"  {src} -> {dst}")
    return 1 if found or wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
