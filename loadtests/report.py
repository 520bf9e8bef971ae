"""How a benchmark script ends: print its table, keep it in the result, write the JSON if asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def report(text: str, result: dict[str, Any], json_path: str | Path | None) -> dict[str, Any]:
    print(text)
    result["table"] = text
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    return result
