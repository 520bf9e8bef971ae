"""A runner's torch.compile helpers: callables of its own (no recompile limit shared with other
runners in the process) and a backend that counts what it compiles."""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)


class CompileCounter:
    """A torch.compile backend that counts the graphs it compiles (each call is one), and those
    after warm-up, then hands the graph to `backend` (inductor, or eager/aot_eager in tests).

    `new_graphs` counts those whose code and input shapes no compile in this process had before:
    the others are graphs an earlier runner already compiled (another engine of the same shape),
    which inductor's graph cache hands back without compiling them again."""

    _seen: set[tuple] = set()  # (graph code, input shapes and dtypes) compiled in this process

    def __init__(self, backend: str | object = "inductor") -> None:
        self.backend = backend
        self.compiles = 0
        self.after_warmup = 0
        self.new_graphs = 0
        self.warm = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.compiles += 1
        key = (gm.code, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                              for t in example_inputs))
        if key not in CompileCounter._seen:
            CompileCounter._seen.add(key)
            self.new_graphs += 1
        if self.warm:
            self.after_warmup += 1
            log.warning("a graph compiled after warm-up (%d so far): a pass shape that warm-up missed",
                        self.after_warmup)
        backend = self.backend
        if isinstance(backend, str):
            backend = torch._dynamo.lookup_backend(backend)
        return backend(gm, example_inputs)


def own_copy(fn):
    """`fn` with a code object of its own: torch.compile keeps its graphs per code object (at most
    `recompile_limit`, then it silently runs the function eagerly), and each runner's graphs are
    specialised to its model and cache, so runners in one process must not share them."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
