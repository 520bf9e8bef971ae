"""The model runner's options a device check asks for, passed through when this tree has them.

The runner is growing options (`attention_backend`: "auto" | "sdpa" | "flex"; `cuda_graphs` for
decode) while the check is written. Each option the check is given reaches the engine the first
way this tree offers: an EngineConfig field of that name, else a keyword of ModelRunner's
constructor (the engine builds its runner by the module's name, so the check hands it a runner
class with the option bound, for the engine's construction only), else it is recorded as
unsupported and the run goes on with the runner's default. The record says which, and what the
runner reports about itself once built (an attribute of the option's name).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from replicas import engine as engine_module
from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.model_runner import ModelRunner


@dataclasses.dataclass
class RunnerOptions:
    via_config: dict[str, Any]
    via_runner: dict[str, Any]
    unsupported: dict[str, Any]
    reported: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def resolve(cls, requested: Mapping[str, Any], config_fields: Iterable[str] | None = None,
                runner_params: Iterable[str] | None = None) -> RunnerOptions:
        """Sort the options given (None: not given) by the way each can reach the runner."""
        if config_fields is None:
            config_fields = [f.name for f in dataclasses.fields(EngineConfig)]
        if runner_params is None:
            runner_params = inspect.signature(ModelRunner.__init__).parameters
        fields, params = set(config_fields), set(runner_params)
        given = {k: v for k, v in requested.items() if v is not None}
        return cls({k: v for k, v in given.items() if k in fields},
                   {k: v for k, v in given.items() if k not in fields and k in params},
                   {k: v for k, v in given.items() if k not in fields and k not in params})

    def build(self, model: Any, tokenizer: Any, **config: Any) -> Engine:
        """An engine over `model` with `config` and these options."""
        cfg = EngineConfig(**config, **self.via_config)
        original = engine_module.ModelRunner
        if self.via_runner:
            engine_module.ModelRunner = functools.partial(original, **self.via_runner)
        try:
            engine = Engine(model, tokenizer, cfg)
        finally:
            engine_module.ModelRunner = original
        self.reported = {k: _plain(getattr(engine.runner, k)) for k in ("attention_backend", "cuda_graphs")
                         if hasattr(engine.runner, k)}
        return engine

    def record(self) -> dict[str, Any]:
        return {"via_config": self.via_config, "via_runner": self.via_runner, "unsupported": self.unsupported,
                "runner_reports": self.reported}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
