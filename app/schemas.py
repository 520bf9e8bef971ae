"""OpenAI request and response models (pydantic), for completions, chat and models.

Requests are strict about types (a string is not a number) and ignore fields they do not
know, like OpenAI's own server; parameters we know but cannot honour are refused with a 400
rather than silently dropped. Ranges (temperature, top_p, ...) are checked once, by
`replicas.request.SamplingParams`, when the ingress builds one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationInfo,
                      field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from replicas.protocol import InvalidRequestError, SamplingParams

Role = Literal["system", "developer", "user", "assistant", "tool"]
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

class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, usage on every chunk too.
    continuous_usage_stats: bool = False


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
    response_format: dict[str, Any] | None = None
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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Structured output is not built yet: a request for it is refused, never ignored."""
        if value is not None and value.get("type", "text") != "text":
            raise ValueError(f"response_format type {value.get('type')!r} is not supported; "
                             "only 'text'")
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

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The request's `SamplingParams`, checked once, here (InvalidRequestError names the
        field). `max_tokens` None: what the serving replica's context and KV cache leave."""
        if max_tokens == 0 and not self.echoes:
            raise InvalidRequestError("max_tokens must be at least 1 (0 only with echo, which "
                                      "returns the scored prompt)", "max_tokens")
        params: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                  "logprobs": self.num_logprobs,
                                  "prompt_logprobs": self.num_prompt_logprobs}
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
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return prompt[0]
        return prompt

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
    def _best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return value

    @field_validator("tools")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported")
        return value

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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
