"""The model runner's options a device check asks for (`attention_backend`: "auto" | "sdpa" |
"flex"; `cuda_graphs` for decode): EngineConfig fields, given to every engine the check builds.
The record says what was asked and what the runner reports about itself once built (an
attribute of the option's name), so a run's JSON shows the kernels it measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from replicas.config import EngineConfig
from replicas.engine import Engine


@dataclasses.dataclass
class RunnerOptions:
    asked: dict[str, Any]
    # EngineConfig fields every engine of the run shares (KV size, max_num_seqs, max_model_len):
    # the compiled graphs' input shapes then repeat from engine to engine, and inductor's graph
    # cache hands back what an earlier engine compiled instead of compiling it cold again.
    shape: dict[str, Any] = dataclasses.field(default_factory=dict)
    reported: dict[str, Any] = dataclasses.field(default_factory=dict)
    # every built engine's compile counter (small; the engines themselves are released)
    counters: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def resolve(cls, requested: Mapping[str, Any]) -> RunnerOptions:
        """The options given (None: not given, the engine's default); an option that is not an
        EngineConfig field is an error, not a silent no-op."""
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        given = {k: v for k, v in requested.items() if v is not None}
        if unknown := sorted(set(given) - fields):
            raise ValueError(f"not EngineConfig fields: {unknown}")
        return cls(given)

    def build(self, model: Any, tokenizer: Any, graphs: bool | tuple[int, ...] = True, **config: Any) -> Engine:
        """An engine over `model` with the shared shape, `config` and these options. Its decode
        graphs: one bucket, max_num_seqs (every stage decodes its full batch, and each bucket is a
        whole-model compile at start), or the buckets `graphs` names, or none (`graphs=False`: a
        stage that never decodes)."""
        config = self.shape | config
        options = {"cuda_graph_sizes": (config.get("max_num_seqs", 128),)} | self.asked
        if graphs is False:
            options = {k: v for k, v in options.items() if k != "cuda_graph_sizes"} | {"cuda_graphs": False}
        elif graphs is not True:
            options["cuda_graph_sizes"] = tuple(graphs)
        engine = Engine(model, tokenizer, EngineConfig(**config, **options))
        self.reported = {k: _plain(getattr(engine.runner, k))
                         for k in ("attention_backend", "cuda_graphs", "path", "compiles", "fallback_error")
                         if hasattr(engine.runner, k)}
        device = engine.runner.device
        if device.type == "cuda":  # what the KV cache, weights, graph pools and workspace left
            self.reported["free_gib_after_build"] = round(torch.cuda.mem_get_info(device)[0] / 2**30, 2)
            self.reported["kv_blocks"] = engine.blocks.num_blocks
            self.reported["block_size"] = engine.blocks.block_size
        if getattr(engine.runner, "compiler", None) is not None:
            self.counters.append(engine.runner.compiler)
        return engine

    def record(self) -> dict[str, Any]:
        """What was asked, what the last runner reported, and over every engine built so far the
        graphs compiled at start and after it (serving should compile none), and how many of them
        were new to the process."""
        return {"asked": self.asked, "runner_reports": self.reported, "engines_compiled": len(self.counters),
                "compiles_at_warmup": sum(c.compiles - c.after_warmup for c in self.counters),
                "compiles_after_warmup": sum(c.after_warmup for c in self.counters),
                # graphs no earlier engine had compiled: what the device compiles cold
                "new_graphs": sum(c.new_graphs for c in self.counters)}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
