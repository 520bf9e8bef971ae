"""OpenAI request and response models (pydantic), for completions, chat and models.

Requests are strict about types (a string is not a number) and ignore fields they do not
know, like OpenAI's own server; parameters we know but cannot honour are refused with a 400
rather than silently dropped. Ranges (temperature, top_p, ...) are checked once, by
`replicas.request.SamplingParams`, when the ingress builds one.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationInfo,
                      field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from app.tools import ToolPlan, call_schema
from replicas.protocol import GuidedDecoding, InvalidRequestError, SamplingParams

Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_BATCHED_PROMPTS = 256  # prompts in one completions request (lm-eval batches them)
INVALID_UNICODE = "invalid_unicode"  # the pydantic error type `app.errors` maps to its field


def find_invalid_unicode(value: Any) -> str | None:
    """The dotted path of the first string (key or value) that is not valid Unicode text.

    JSON may spell lone surrogates (`"\\ud800"`); Python keeps them in the string, and the
    tokenizer (and any UTF-8 encoder) fails on them, so they are refused at the edge. The walk
    is iterative: nesting as deep as the JSON parser allows cannot overflow the stack.
    """
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):  # reversed: popped in order
                name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # printable
                where = f"{path}.{name}" if path else name
                todo += [(child, where), (key, where)]
        elif isinstance(item, list):
            todo += [(child, f"{path}.{i}" if path else str(i)) for i, child in reversed(list(enumerate(item)))]
    return None


class _Part(BaseModel):
    """A part of a request body: strict about types, unknown keys ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, usage on every chunk too.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Part):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(_Part):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields): one of them."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GenerationRequest(BaseModel):
    """Fields completions and chat share, plus our extensions (`priority`, vLLM's extras)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; 0 or -1 disables it")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extensions (llguidance compiles them on the replica).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: int = Field(0, description="scheduling class; lower is more urgent")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="vLLM extension; 1 disables it")
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, description="vLLM extension: no EOS or stop before this many tokens")
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (where := find_invalid_unicode(data)) is not None:
            raise PydanticCustomError(INVALID_UNICODE, "{param}: invalid Unicode (a lone surrogate?)",
                                      {"param": where})
        return data

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _compact_json_only(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("guided_whitespace_pattern is not supported: JSON is generated compact")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM: only together with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def num_logprobs(self) -> int | None:
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: the prompt is not scored)."""
        return None

    @property
    def echoes(self) -> bool:
        """The response starts with the prompt (completions' `echo`): max_tokens may be 0."""
        return False

    def output_constraints(self) -> list[GuidedDecoding]:
        """Every output constraint the request sets (each checked; the caller allows one)."""
        found: list[GuidedDecoding] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(GuidedDecoding("json_object", param="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            found.append(GuidedDecoding("json_schema", json.dumps(fmt.json_schema.schema_), "response_format"))
        so = self.structured_outputs
        for name, kind, value in (
                ("guided_json", "json_schema", self.guided_json),
                ("guided_regex", "regex", self.guided_regex),
                ("guided_choice", "choice", self.guided_choice),
                ("guided_grammar", "grammar", self.guided_grammar),
                ("structured_outputs.json", "json_schema", so and so.json_),
                ("structured_outputs.regex", "regex", so and so.regex),
                ("structured_outputs.choice", "choice", so and so.choice),
                ("structured_outputs.grammar", "grammar", so and so.grammar)):
            if value is not None:
                spec = json.dumps(value) if isinstance(value, dict) else value
                found.append(GuidedDecoding(kind, spec, name))
        if so is not None and so.json_object:
            found.append(GuidedDecoding("json_object", param="structured_outputs.json_object"))
        return found

    def guided_decoding(self) -> GuidedDecoding | None:
        """The output constraint, or None; two are a 400 naming the second."""
        found = self.output_constraints()
        if len(found) > 1:
            raise InvalidRequestError(f"{found[1].param}: a request takes one output constraint, and "
                                      f"{found[0].param} is already set", found[1].param)
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The request's `SamplingParams`, checked once, here (InvalidRequestError names the
        field). `max_tokens` None: what the serving replica's context and KV cache leave."""
        if max_tokens == 0 and not self.echoes:
            raise InvalidRequestError("max_tokens must be at least 1 (0 only with echo, which "
                                      "returns the scored prompt)", "max_tokens")
        params: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                  "logprobs": self.num_logprobs, "n": self.n,
                                  "prompt_logprobs": self.num_prompt_logprobs, "guided": self.guided_decoding()}
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens"):
            if (value := getattr(self, name)) is not None:
                params[name] = value
        if self.logit_bias:
            params["logit_bias"] = _token_bias(self.logit_bias)
        if self.top_k is not None:
            params["top_k"] = 0 if self.top_k == -1 else self.top_k
        if self.stop is not None:
            params["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = tuple(self.stop_token_ids)
        return SamplingParams(**params)


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias's JSON keys (strings) as token ids; the ranges are SamplingParams' to check."""
    ids: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):  # digits only: no sign, space or underscore
            raise InvalidRequestError(f"logit_bias keys must be token ids (decimal integers), "
                                      f"got {key!r}", "logit_bias")
        ids[int(key)] = value
    return ids


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and len(prompt) > MAX_BATCHED_PROMPTS and isinstance(prompt[0], (str, list)):
            raise ValueError(f"a batch takes at most {MAX_BATCHED_PROMPTS} prompts, got {len(prompt)}")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (text or token ids), or a batch of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """With echo, logprobs cover the prompt's tokens too (lm-eval's loglikelihood)."""
        return self.logprobs if self.echo else None

    @property
    def echoes(self) -> bool:
        return self.echo

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of must equal n when given: generating more samples than are "
                             "returned and keeping the best is not supported (vLLM V1 dropped it too)")
        return value


class TextPart(_Part):
    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Part):
    """A call an earlier assistant turn made (sent back by the client in `messages`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it; a call's arguments as an object (what the
        Hermes / Qwen / Llama templates render), or the JSON text when it is not JSON."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # forced calls always follow the schema


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # either way a response carries at most one call

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("function names must be distinct")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if choice is not None and choice != "none" and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in tools}:
            raise ValueError(f"function {choice.function.name!r} is not in tools")
        return choice

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """How tool calls are made and read back (None: no tools in play). "auto" needs a
        tool-call parser; without one it is a 400 naming tool_choice."""
        choice = self.effective_tool_choice
        if choice == "none":
            return None
        if choice != "auto":
            return self._forced_plan()
        if parser is None:
            raise InvalidRequestError(
                "tool_choice 'auto' (the default when tools are given) needs a tool-call parser, and "
                "this server has none (tool_call_parser: hermes enables it); send tool_choice "
                "'required', a named function, or 'none'", "tool_choice", code="unsupported")
        return ToolPlan("hermes", tuple(t.function.name for t in self.tools))

    def _forced_plan(self) -> ToolPlan:
        """tool_choice "required" or a named function; "required" with one tool is that tool."""
        names = tuple(t.function.name for t in self.tools)
        choice = self.effective_tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if name is None and len(names) == 1:
            name = names[0]
        return ToolPlan("named" if name else "required", names, name)

    def output_constraints(self) -> list[GuidedDecoding]:
        """A forced tool call is generated under its call's schema; any other constraint with
        tools in play is refused (a tool call and a formatted answer cannot share one grammar)."""
        found = super().output_constraints()
        choice = self.effective_tool_choice
        if choice == "none":
            return found
        if found:
            raise InvalidRequestError(f"{found[0].param}: an output constraint cannot be combined "
                                      "with tools (unless tool_choice is 'none')", found[0].param)
        if choice == "auto":
            return []
        tools = {t.function.name: t.function.parameters for t in self.tools}
        return [GuidedDecoding("json_schema", json.dumps(call_schema(tools, self._forced_plan().name)),
                               "tools")]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as chat templates take them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine computes (None: no logprobs asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses --------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token (with echo, a
    prompt's first token has null token_logprobs and top_logprobs)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobContent(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobContent]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    """A completion, or (with `usage` unset) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class DeltaToolCall(ResponseToolCall):
    index: int = 0


class AssistantMessage(BaseModel):
    """The answer: content, or (content null) the tool calls; `tool_calls` only when made."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed piece of the assistant message; unset fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stallfree-serve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
