"""How a benchmark script starts (the common flags, the model loaded) and ends (print its
table, keep it in the result, write the JSON if asked)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def bench_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A parser with the flags every engine benchmark takes: --model --threads --repeats --json."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    p.add_argument("--model", default="embedded:mid")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    return p


def load_bench_model(args: argparse.Namespace) -> Any:
    """Torch threads set, transformers quiet, then `(model, tokenizer)` of `args.model`."""
    import torch
    import transformers

    from replicas.models import load_model

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    return load_model(args.model)


def report(text: str, result: dict[str, Any], json_path: str | Path | None) -> dict[str, Any]:
    print(text)
    result["table"] = text
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    return result
