"""`GET /metrics` on the HTTP port: this application's Prometheus series, gathered from Ray.

The replicas record through `ray.util.metrics`; Ray's agent on every node exports them (with
Serve's `application`/`deployment`/`replica` tags) on the node's metrics export port. A client
or a single-machine user should not need to know that port, so the ingress fetches every alive
node's export, keeps the `ray_stallfree_` series of its own application (and their HELP/TYPE
lines), and the proxy door's (`ray_stallfree_proxy_`: a node's HTTP proxy serves every
application, so they carry none), and answers with the Prometheus text. Ray's own export stays
as it is.

The engine's histograms are counted in the replica and exported through Ray as gauges of their
cumulative counts (`replicas.serving.metric_backends.GaugeHistogram`: Ray's agent would otherwise
rebuild every observation); here the three gauges `X_bucket`, `X_sum`, `X_count` are served as
the one histogram `X` they are (`TYPE histogram`, its buckets in `le` order).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable

import httpx

PREFIX = "ray_stallfree_"
NODE_WIDE = PREFIX + "proxy_"  # the proxy door's series (app/proxy_door.py): no application tag
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")


def app_series(texts: Iterable[str], application: str, prefix: str = PREFIX) -> str:
    """The lines of Prometheus exposition `texts` that belong to `application`'s metrics:
    samples named `prefix...` tagged `application="<application>"`, and the proxy door's, with
    their HELP and TYPE lines once per metric family (first seen), in the order met."""
    tag = f'application="{application}"'
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                if name.startswith(prefix):
                    kept = headers.setdefault(name, [])
                    if len(kept) < 2 and line not in kept:
                        kept.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None or not m.group(1).startswith(prefix):
                continue
            if tag not in (m.group(2) or "") and not m.group(1).startswith(NODE_WIDE):
                continue
            families.setdefault(_family(m.group(1), headers), []).append(line)
    out = []
    for family, samples in _as_histograms(families, headers).items():
        out += headers.get(family, [])
        out += samples
    return "\n".join(out) + "\n" if out else ""


_LE = re.compile(r',?le="([^"]*)"')
_PARTS = ("_bucket", "_sum", "_count")


def _as_histograms(families: dict[str, list[str]], headers: dict[str, list[str]]) -> dict[str, list[str]]:
    """`families` with each gauge triple `X_bucket` / `X_sum` / `X_count` made the histogram
    family `X`, in `X_bucket`'s place (its HELP line and a histogram TYPE written into `headers`)."""
    def is_gauge(name: str) -> bool:
        return f"# TYPE {name} gauge" in headers.get(name, [])

    bases = {f.removesuffix("_bucket") for f in families if f.endswith("_bucket")}
    bases = {b for b in bases if all(b + part in families and is_gauge(b + part) for part in _PARTS)}
    merged = {b + part for b in bases for part in _PARTS}
    out: dict[str, list[str]] = {}
    for family, samples in families.items():
        if family not in merged:
            out[family] = samples
        elif family.endswith("_bucket"):
            base = family.removesuffix("_bucket")
            doc = next((h.split(" ", 3)[3] for h in headers[family] if h.startswith("# HELP ") and h.count(" ") >= 3), "")
            headers[base] = [f"# HELP {base} {doc}", f"# TYPE {base} histogram"]
            out[base] = sorted(samples, key=_bucket_order) + families[base + "_sum"] + families[base + "_count"]
    return out


def _bucket_order(line: str) -> tuple[str, float]:
    """A bucket sample's series (its labels less `le`), then its bound."""
    m = _LE.search(line)
    le = float("inf") if m is None or m.group(1) == "+Inf" else float(m.group(1))
    return _LE.sub("", line.split(" ", 1)[0]), le


def _family(sample_name: str, headers: dict[str, list[str]]) -> str:
    """A histogram's `_bucket`/`_sum`/`_count` samples belong to the family without it."""
    for suffix in ("_bucket", "_sum", "_count", "_total"):
        base = sample_name.removesuffix(suffix)
        if base != sample_name and base in headers:
            return base
    return sample_name


def export_urls() -> list[str]:
    """Every alive Ray node's metrics export endpoint (a GCS call: run it off the event loop)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


async def scrape(application: str, timeout_s: float = 5.0) -> str:
    """This application's series from every node's export (a node that does not answer is
    skipped: its series are missing from this scrape, as Prometheus would see it)."""
    urls = await asyncio.get_running_loop().run_in_executor(None, export_urls)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        replies = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    texts = [r.text for r in replies if isinstance(r, httpx.Response) and r.status_code == 200]
    return app_series(texts, application)
