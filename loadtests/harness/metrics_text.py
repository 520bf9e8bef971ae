"""Prometheus text exposition, read: the samples of a `/metrics` page (Ray's export, or the
app's own), for the load tests that count what the server says it did."""

from __future__ import annotations

import re
from collections.abc import Iterator

_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, names: tuple[str, ...] | None = None) -> Iterator[tuple[str, dict[str, str], float]]:
    """(metric name, labels, value) of every sample line (of `names` only, when given)."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m or (names is not None and m.group(1) not in names):
            continue
        yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
