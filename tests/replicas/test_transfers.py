"""A pass copies to the device once and back once: over passes mixing decodes, prefill chunks
with context, prompt logprobs and every sampling feature, the replica's own code makes one
host-to-device copy (the packed metadata) and one device-to-host copy (tokens and logprobs).

CPU stands in for the device: copies are counted where the code asks for them (a tensor made
from host data on the pass's device, `.to(device)`, indexing with a host list or array,
`.cpu()`, `.tolist()`, `.item()`, `.numpy()`, `bool()`/`int()`/`float()` of a tensor), from
frames in the `replicas` package; reading a tensor that was made on the host, or copied back
already, is not a copy."""

from __future__ import annotations

import json
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import replicas
from replicas import Engine, EngineConfig, SamplingParams
from replicas.protocol import GuidedDecoding

PACKAGE = os.path.dirname(replicas.__file__) + os.sep
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0.8),
    SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=1),
    SamplingParams(max_tokens=8, temperature=1.3, top_p=0.9, seed=2),  # a nucleus wider than the candidates
    SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.8, seed=4),
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=2),
    SamplingParams(max_tokens=8, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5,
                   repetition_penalty=1.2, seed=5, logprobs=1),
    SamplingParams(max_tokens=8, temperature=0.0, logit_bias={5: 3.0}, min_tokens=4),
    SamplingParams(max_tokens=10, temperature=0.0, guided=GuidedDecoding("json_schema", SCHEMA)),
    SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3, prompt_logprobs=1),
    SamplingParams(max_tokens=8, temperature=0.0),
]
PROMPTS = ["Hello world", "A longer prompt about serving systems and their batches, " * 3]


class Copies:
    """Host-to-device and device-to-host copies asked for by replicas code, per engine step."""

    def __init__(self) -> None:
        self.passes: list[tuple[list[str], list[str]]] = []  # (h2d sites, d2h sites) per pass
        self._h2d: list[str] = []
        self._d2h: list[str] = []
        self._host: dict[int, weakref.ref] = {}  # made on or copied to the host, by id

    def _site(self) -> str | None:
        frame = sys._getframe(3)  # the caller of the patched torch function
        name = frame.f_code.co_filename
        return f"{os.path.basename(name)}:{frame.f_lineno}" if name.startswith(PACKAGE) else None

    def h2d(self) -> None:
        if (site := self._site()) is not None:
            self._h2d.append(site)

    def d2h(self, t: torch.Tensor) -> None:
        known = self._host.get(id(t))
        if (known is None or known() is not t) and (site := self._site()) is not None:
            self._d2h.append(site)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        self._host[id(t)] = weakref.ref(t)
        return t

    def end_pass(self) -> None:
        self.passes.append((self._h2d, self._d2h))
        self._h2d, self._d2h = [], []


def _is_device(x: object) -> bool:
    return isinstance(x, (str, torch.device))


def _on_cpu(kwargs: dict) -> bool:
    """Made on the host: replicas code spells the host `device="cpu"`; the pass's device is
    a torch.device (which on these machines is the CPU too)."""
    return isinstance(kwargs.get("device"), str) and kwargs["device"] == "cpu"


@contextmanager
def counting(copies: Copies) -> Iterator[None]:
    """Patch torch's copy points to report to `copies` while the block runs."""
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def factory(fn):  # made on the host when asked for device="cpu", else data sent to the device
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            if _on_cpu(kwargs):
                copies.host(out)
            elif kwargs.get("device") is not None and fn in (torch_tensor, torch_as_tensor):
                copies.h2d()
            return out
        return wrapped

    torch_tensor, torch_as_tensor = torch.tensor, torch.as_tensor
    for name in ("tensor", "as_tensor", "rand", "empty", "zeros", "full"):
        patch(torch, name, factory)

    def to(fn):
        def wrapped(self, *args, **kwargs):
            if any(_is_device(a) for a in args) or kwargs.get("device") is not None:
                copies.h2d()
            return fn(self, *args, **kwargs)
        return wrapped

    def back(fn):
        def wrapped(self, *args, **kwargs):
            copies.d2h(self)
            return fn(self, *args, **kwargs)
        return wrapped

    def cpu(fn):
        def wrapped(self, *args, **kwargs):
            copies.d2h(self)
            return copies.host(fn(self, *args, **kwargs))
        return wrapped

    def indexed(fn):  # an index (or value) from a host list or array is copied to the device
        def wrapped(self, key, *value):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, (list, np.ndarray)) for k in keys + value):
                copies.h2d()
            return fn(self, key, *value)
        return wrapped

    patch(torch.Tensor, "to", to)
    patch(torch.Tensor, "cuda", to)
    patch(torch.Tensor, "cpu", cpu)
    for name in ("tolist", "item", "numpy", "__bool__", "__int__", "__float__"):
        patch(torch.Tensor, name, back)
    patch(torch.Tensor, "__getitem__", indexed)
    patch(torch.Tensor, "__setitem__", indexed)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def count_passes(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> Copies:
    """Generate under `counting`, one record per pass."""
    copies = Copies()
    step = engine.step

    def counted_step():
        out = step()
        if engine.iterations and len(copies.passes) < len(engine.iterations):
            copies.end_pass()
        return out

    engine.step = counted_step
    try:
        with counting(copies):
            engine.generate(prompts, params)
    finally:
        engine.step = step
    return copies


@pytest.mark.engine
def test_each_pass_copies_in_once_and_out_once(monkeypatch) -> None:
    from replicas.execution import sampler

    # The accelerator's sampling strategy (top-p rows sort their vocabulary, nothing is checked
    # or picked on the host), on CPU.
    monkeypatch.setattr(sampler, "is_host", lambda device: False)
    engine = Engine.from_pretrained("embedded:tiny", EngineConfig(max_batch_prefill_tokens=24,
                                                                  max_batch_total_tokens=2048))
    copies = count_passes(engine, PROMPTS * (len(PARAMS) // 2), PARAMS)
    iterations = list(engine.iterations)
    assert len(copies.passes) == len(iterations) > 5
    assert any(it.num_prefill_tokens and it.num_decode_tokens for it in iterations)
    assert any(it.num_prefill_tokens and it.num_prefill_tokens < 24 for it in iterations)
    for i, (h2d, d2h) in enumerate(copies.passes):
        assert len(h2d) == 1, f"pass {i}: host-to-device copies at {h2d}"
        assert len(d2h) == 1, f"pass {i}: device-to-host copies at {d2h}"


@pytest.mark.unit
def test_the_counter_sees_the_copies_it_should() -> None:
    """The harness itself: a tensor made from host data on a device, `.to(device)`, list
    indexing and each kind of read-back count; host-made tensors and copies back do not."""
    copies = Copies()
    with counting(copies):
        _touch_from_replicas_frame(copies)
    copies.end_pass()
    h2d, d2h = copies.passes[0]
    assert len(h2d) == 3 and len(d2h) == 4


def _touch_from_replicas_frame(copies: Copies) -> None:
    """Run the copies with a code object whose file is in the package (as replicas code is)."""
    source = ("def run(torch):\n"
              "    x = torch.tensor([1.0, 2.0], device=torch.device('cpu'))\n"  # h2d (a device's: cpu here)
              "    y = torch.zeros(3).to(torch.device('cpu'))\n"  # h2d
              "    z = x[[0, 1]]\n"  # h2d (the list index)
              "    host = torch.rand(2, device='cpu')\n"
              "    host.numpy()\n"  # made on the host: nothing
              "    z.tolist(); y.sum().item(); bool(x.any())\n"  # 3 x d2h
              "    back = z.cpu()\n"  # d2h
              "    back.tolist()\n")  # copied back already: nothing
    code = compile(source, os.path.join(PACKAGE, "harness_probe.py"), "exec")
    scope: dict = {}
    exec(code, scope)
    scope["run"](torch)


def main() -> None:
    """Print the copies per pass of the `replicas` on the path (today's tree, or another's
    with PYTHONPATH): `python tests/replicas/test_transfers.py [--device-sampling] [--json PATH]`."""
    import argparse
    import statistics

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--device-sampling", action="store_true", help="the accelerator's top-p strategy")
    p.add_argument("--greedy", action="store_true", help="plain greedy requests only (the common pass)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from replicas.execution import sampler

    if args.device_sampling and hasattr(sampler, "is_host"):
        sampler.is_host = lambda device: False
    elif args.device_sampling and hasattr(sampler, "sorts_top_p"):  # an older tree
        sampler.sorts_top_p = lambda device: True
    engine = Engine.from_pretrained("embedded:tiny", EngineConfig(max_batch_prefill_tokens=24,
                                                                  max_batch_total_tokens=2048))
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(PARAMS) if args.greedy else PARAMS
    copies = count_passes(engine, PROMPTS * (len(PARAMS) // 2), params)
    out: dict = {"tree": PACKAGE, "device_sampling": args.device_sampling, "greedy": args.greedy,
                 "passes": len(copies.passes)}
    for k, name in enumerate(("h2d", "d2h")):
        counts = [len(p[k]) for p in copies.passes]
        sites: dict[str, int] = {}
        for p in copies.passes:
            for site in p[k]:
                sites[site] = sites.get(site, 0) + 1
        out[name] = {"median": statistics.median(counts), "min": min(counts), "max": max(counts),
                     "total": sum(counts), "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]))}
    print(json.dumps({k: v if not isinstance(v, dict) else {x: y for x, y in v.items() if x != "sites"}
                      for k, v in out.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()


@pytest.mark.unit
def test_download_takes_empty_parts_whatever_their_strides() -> None:
    from replicas.execution.transfer import download

    import numpy as np

    no_rows = torch.from_numpy(np.zeros((0, 5), np.float32).argmax(axis=-1))  # stride 0 in numpy
    out = download([torch.tensor([3, 4]), no_rows, torch.tensor([1.5])])
    assert out[0].tolist() == [3, 4] and out[1].size == 0 and out[2].tolist() == [1.5]
