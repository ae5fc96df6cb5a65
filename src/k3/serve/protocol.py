"""Request bodies of the OpenAI-compatible API (SPEC §6.4) as Pydantic models, and the error type.

Unknown request fields are refused (``extra="forbid"``), so nothing a client sends is silently
ignored; messages and tools stay plain JSON objects and are validated by the one renderer
(``k3.data.chat.ChatFormat``), which names the offending field.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "StreamOptions", "error_body"]

Number = Union[StrictInt, StrictFloat]


class ApiError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints; ``max_tokens`` None = the room left in the context."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=1)
    min_p: Number = Field(default=0.0, ge=0, le=1)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(default=1.0, gt=0)
    seed: StrictInt | None = None
    n: Literal[1] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # extension (as vLLM): run to max_tokens past the model's EOS
    user: StrictStr | None = None  # an end-user tag (OpenAI); recorded nowhere, affects nothing


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Literal["low", "high", "max"] | None = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    stop: Union[StrictStr, list[StrictStr], None] = None
    # OpenAI's legacy completions: ``logprobs`` n reports each token's logprob and its top-n
    # alternatives; ``echo`` puts the prompt before the completion, in the text and the logprobs
    # (its first token's logprob null); ``max_tokens`` 0 with ``echo`` scores the prompt only
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    max_tokens: StrictInt | None = Field(default=None, ge=0)
