"""The OpenAI API subset `hexq serve` speaks: request bodies as pydantic models (wrong types and unknown fields are
400s with the field named), and the response and stream-chunk shapes the OpenAI clients parse.

Fields of the OpenAI API that hexq does not implement (logprobs, penalties, n > 1, tools, ...) are accepted by
name and refused with a 400 naming them when set to anything but their neutral value: a client is told, never
silently served something else.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 16  # stop strings per request (OpenAI allows 4)


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def unsupported(self) -> list[str]:
        """The fields set to something hexq does not serve."""
        return [name for name, neutral in self._neutral().items() if getattr(self, name) not in neutral]

    @staticmethod
    def _neutral() -> dict[str, tuple]:
        return {}


class Sampled(Base):
    """What both endpoints share."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0: no cut (vLLM's and llama.cpp's spelling)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return bool((self.stream_options or {}).get("include_usage"))

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value):
        if value is not None and set(value) - {"include_usage"}:
            raise ValueError("only include_usage is known")
        return value

    @staticmethod
    def _neutral() -> dict[str, tuple]:
        return {"n": (1,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {}),
                "logprobs": (None, False, 0)}


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @staticmethod
    def _neutral() -> dict[str, tuple]:
        return Sampled._neutral() | {"echo": (False,), "best_of": (None, 1), "suffix": (None,)}


class TextPart(Base):
    type: Literal["text"]
    text: str


class Message(Base):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    @staticmethod
    def _neutral() -> dict[str, tuple]:
        return Sampled._neutral() | {"top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
                                     "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,)}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error shape (what the clients turn into their exceptions)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_chunk(request_id: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(request_id: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The usage object; cached_tokens: the prompt's tokens taken from the previous prompt (hexq.runtime.prefix)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def now() -> int:
    return int(time.time())
