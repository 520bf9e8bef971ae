"""Fixtures of the app tests: the offline reference engine and HTTP clients.

The session-wide Ray/Serve fixtures (`ray_serve`, `serve_app`) live in tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest

from replicas import Engine, SamplingParams


@dataclass
class Reference:
    """The served model and budgets run in-process (no Ray): what HTTP answers must equal."""

    engine: Engine

    def greedy(self, prompt: str | list[int], max_tokens: int, **params: object) -> str:
        """Offline greedy text for one prompt."""
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
        return self.engine.generate([prompt], sampling)[0].text

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """What the ingress sends the replica for `messages`: the chat template, tokenized."""
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def num_tokens(self, text: str) -> int:
        return len(self.engine.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="session")
def reference(serve_app) -> Reference:  # noqa: ANN001 - tests/conftest.py ServeApp
    config = serve_app.args.engine.replace(num_threads=None)
    return Reference(Engine.from_pretrained(serve_app.args.model, config))


@pytest.fixture
def client(serve_app) -> Iterator[httpx.Client]:  # noqa: ANN001
    with httpx.Client(base_url=serve_app.base_url, timeout=60) as c:
        yield c


@pytest.fixture
async def aclient(serve_app) -> AsyncIterator[httpx.AsyncClient]:  # noqa: ANN001
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=serve_app.base_url, timeout=120, limits=limits) as c:
        yield c
