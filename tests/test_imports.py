"""The product imports one way (app -> autoscale -> replicas) and has no import cycle, lazy
imports included; the graph itself is read right (a planted cycle and a relative import)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import import_graph

pytestmark = pytest.mark.unit


def test_the_product_has_no_import_cycle_and_imports_one_way() -> None:
    g = import_graph.graph()
    assert "replicas.engine" in g and "app.ingress" in g
    assert "replicas.loading.model_files" in g["app.ingress"]  # a module-level import is seen
    assert "autoscale.controller" in g["app.admission"]  # so is one inside a function
    assert import_graph.cycles(g) == []
    assert list(import_graph.backward(g)) == []


def test_cycles_and_relative_imports_are_found(tmp_path: Path) -> None:
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert list(import_graph.backward({"replicas.x": {"autoscale.y"}, "app.z": {"replicas.x"}})) == \
        [("replicas.x", "autoscale.y")]
    module = tmp_path / "mod.py"
    module.write_text("def f():\n    from .sibling import thing\n    import pkg.other\n")
    assert import_graph.imports(module, "pkg.mod", {"pkg.sibling", "pkg.other", "pkg.mod"}) == \
        {"pkg.sibling", "pkg.other"}
