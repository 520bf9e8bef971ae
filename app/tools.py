"""Tool calls: the grammar a forced call is generated under, and reading calls out of the text.

- `tool_choice` "required" or a named function: the output is constrained (`replicas.execution.guided`)
  to the JSON of one call, so it always parses once the grammar is complete. A named function's
  output is its arguments object; "required" generates `{"name": ..., "arguments": {...}}`,
  one alternative (anyOf) per tool. One call per response.
- `tool_choice` "auto" with the `hermes` parser: free text, from which `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks (the Hermes / Qwen chat templates' format) are taken
  as calls; the text before the first block is the content. A block that is not such a JSON
  object, or names a function not in `tools`, leaves the whole text as content (vLLM's hermes
  parser does the same for bad JSON).

A `ToolCallReader` serves streamed and whole responses alike: `feed` each text delta (it returns
the content safe to send now), then `finish` for the rest and the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)
# OpenAI: omitting `parameters` defines a function with an empty parameter list.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tool calls are made and read back."""

    mode: Literal["named", "required", "hermes"]
    names: tuple[str, ...]  # the functions in `tools`
    name: str | None = None  # "named": the function; the whole output is its arguments


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")


def call_schema(tools: dict[str, dict[str, Any] | None], name: str | None) -> dict[str, Any]:
    """The JSON schema of a forced call: the named function's parameters, or (`name` None, for
    "required") one `{"name", "arguments"}` object per function in `tools` (name -> parameters)."""
    if name is not None:
        return _parameters(tools[name])
    return {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": n}, "arguments": _parameters(p)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for n, p in tools.items()]}


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return NO_PARAMETERS if schema is None else schema


class ToolCallReader:
    """Splits a response's text into content and tool calls, as the text streams in."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` handed out as content
        self._in_call = False  # hermes: a `<tool_call>` began; the rest is held

    def feed(self, delta: str) -> str:
        """Take a text delta; return the content that can be sent now. A forced call's text is
        all call; with hermes, text from a `<tool_call>` on (or what may begin one) is held."""
        self.text += delta
        if self.plan.mode != "hermes" or self._in_call:
            return ""
        # What was held back may begin the tag; nothing before `sent` can.
        start = self.text.find(HERMES_OPEN, self.sent)
        self._in_call = start >= 0
        end = start if start >= 0 else len(self.text) - _partial_suffix(self.text, HERMES_OPEN)
        out, self.sent = self.text[self.sent:end], max(end, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet handed out, and the calls (empty when the text holds none)."""
        calls = self._calls()
        rest = "" if calls else self.text[self.sent:]
        self.sent = len(self.text)
        return rest, calls

    def _calls(self) -> list[ToolCall]:
        plan, text = self.plan, self.text
        if plan.mode == "named":
            return [ToolCall(plan.name, text)] if _json_object(text) is not None else []
        if plan.mode == "required":
            call = _call(_json_object(text), plan.names)
            return [call] if call is not None else []
        blocks = _HERMES_BLOCK.findall(text)
        calls = [_call(_json_object(b.strip()), plan.names) for b in blocks]
        return calls if calls and all(c is not None for c in calls) else []  # type: ignore[return-value]


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _call(obj: dict[str, Any] | None, names: tuple[str, ...]) -> ToolCall | None:
    """`{"name": <a function in tools>, "arguments": {...}}` as a call, else None."""
    if obj is None or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False, separators=(",", ":")))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
