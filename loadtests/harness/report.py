"""How a benchmark script starts (the common flags, the model loaded) and ends (print its
table, keep it in the result, write the JSON if asked)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

OMIT = False  # a flag `bench_parser` leaves out: the script has no use for it
Flag = Literal[False]


def bench_parser(module: str, doc: str, *, model: str | None | Flag = "embedded:mid", model_help: str | None = None,
                 seed: int | Flag = 0, json_path: str | Path | None | Flag = None, quick: str | None = None,
                 threads: int | None | Flag = OMIT, repeats: int | None | Flag = OMIT, repeats_help: str | None = None,
                 formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """The parser every benchmark script starts from, so a flag means the same everywhere:
    --model, --seed (the workload's), --json (the results; `json_path` its default), --quick
    (when `quick` says what it does), --threads and --repeats (engine benchmarks: torch threads,
    runs per system). Each argument is the flag's default; OMIT leaves the flag out."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.strip().splitlines()[0],
                                formatter_class=formatter_class)
    if model is not OMIT:
        p.add_argument("--model", default=model, help=model_help or "embedded:NAME, a model directory, "
                       "a .gguf file or a hub id")
    if seed is not OMIT:
        p.add_argument("--seed", type=int, default=seed, help="workload seed")
    if json_path is not OMIT:
        p.add_argument("--json", type=Path, default=None if json_path is None else Path(json_path),
                       help="write the results here as JSON")
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if threads is not OMIT:
        p.add_argument("--threads", type=int, default=threads, help="torch intra-op threads")
    if repeats is not OMIT:
        p.add_argument("--repeats", type=int, default=repeats,
                       help=repeats_help or "runs per system, interleaved; medians reported")
    return p


def load_bench_model(args: argparse.Namespace) -> Any:
    """Torch threads set, transformers quiet, then `(model, tokenizer)` of `args.model`."""
    import torch
    import transformers

    from replicas.loading.models import load_model

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    return load_model(args.model)


def jsonable(value: Any) -> Any:
    """What json.dumps cannot write itself: numpy scalars as numbers, anything else (a path) as text."""
    if isinstance(value, Path):
        return str(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def write_json(path: str | Path, result: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=jsonable) + "\n")


def report(text: str, result: dict[str, Any], json_path: str | Path | None) -> dict[str, Any]:
    print(text)
    result["table"] = text
    if json_path:
        write_json(json_path, result)
    return result
