"""Who builds a model: only a process that loads it. `model_files` names and caches and imports
nothing of the project; the ingress's tokenizer on a cold cache is prepared in a process of its
own (`python -m replicas.loading.prepare`), so torch never loads in the ingress; the support checks and
the KV shape need no torch; the modules that prepare models import one way."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOADING = Path(__file__).resolve().parents[2] / "replicas" / "loading"


def project_imports(module: str) -> set[str]:
    """Every `replicas.*` module `module` imports, at the top or inside a function."""
    tree = ast.parse((LOADING / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module in ("replicas", "replicas.loading"):
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif node.module.startswith("replicas."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("replicas.")}
    return found


@pytest.mark.unit
def test_the_model_modules_import_one_way():
    assert project_imports("model_files") == set()  # names and caches only
    assert project_imports("model_support") == set()
    assert project_imports("embedded") == {"replicas.loading.model_files"}
    assert project_imports("gguf") == {"replicas.loading.model_support"}
    assert project_imports("prepare") == {"replicas.loading.embedded", "replicas.loading.gguf", "replicas.loading.model_files"}
    assert "replicas.loading.prepare" in project_imports("models")


@pytest.mark.process
def test_the_tokenizer_on_a_cold_cache_loads_no_torch_here(tmp_path):
    """A fresh interpreter with an empty cache asks for embedded:tiny's tokenizer (what the
    ingress does): the model is built by a process of its own, and torch is not imported here."""
    code = ("import sys, json; from replicas.loading.model_files import load_tokenizer, resolve_model_path;"
            "tok = load_tokenizer('embedded:tiny');"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'ids': tok.encode('hello world'),"
            " 'path': resolve_model_path('embedded:tiny')}))")
    env = {**os.environ, "STALLFREE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch"] is False and len(out["ids"]) >= 2
    assert Path(out["path"]) == tmp_path / "models" / "tiny-v2" and (Path(out["path"]) / "model.safetensors").is_file()


@pytest.mark.process
def test_a_model_that_cannot_be_prepared_is_refused_by_name(tmp_path, monkeypatch):
    from replicas.loading.model_files import resolve_model_path

    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model_path(str(bad))


@pytest.mark.process
def test_support_checks_and_kv_shape_need_no_torch():
    code = ("import sys; from types import SimpleNamespace as C;"
            "from replicas.loading.model_support import check_supported, kv_shape, model_max_length;"
            "c = C(model_type='llama', num_attention_heads=8, num_key_value_heads=2, hidden_size=512,"
            " num_hidden_layers=3, max_position_embeddings=4096);"
            "check_supported(c); print(kv_shape(c), model_max_length(c), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(3,", "2,", "64)", "4096", "False"]
