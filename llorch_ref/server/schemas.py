"""The request bodies the worker accepts, strictly (unknown fields refused, nothing coerced), and the
names it answers with (stop reasons, OpenAI finish reasons)."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

STOP_REASONS = {"max_tokens": "MAX_TOKENS", "eos": "EOS", "stop_sequence": "STOP_SEQUENCE",
                "cancelled": "CANCELLED", "context_full": "MAX_TOKENS"}
OPENAI_FINISH = {"max_tokens": "length", "context_full": "length", "eos": "stop", "stop_sequence": "stop",
                 "cancelled": "stop"}


class Strict(BaseModel):
    """Unknown fields are refused, and nothing is coerced: "2" is not a number, true is not 1."""
    model_config = ConfigDict(extra="forbid", strict=True)


class Sampling(Strict):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    max_tokens: int | None = Field(default=None)


# job ids go into the X-Job-Id header: visible ASCII only, so the response can never fail after queueing
JOB_ID_PATTERN = r"[!-~]{1,200}"


class ExecuteRequest(Sampling):
    job_id: str | None = None
    prompt: str = Field(min_length=1)

    @field_validator("job_id")
    @classmethod
    def _header_safe(cls, v):
        if v is not None and not re.fullmatch(JOB_ID_PATTERN, v):
            raise ValueError("1-200 visible ASCII characters, no spaces (it is sent back in the X-Job-Id header)")
        return v


class TokenizeRequest(Strict):
    content: str


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Sampling):
    """Fields the official client sends that llorch-ref applies, or accepts only at their no-op value."""
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None               # an end-user id for the provider's abuse monitoring: nothing to apply
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)
    repeat_penalty: float | None = None   # llama-cpp-python's name of repetition_penalty

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if self.repeat_penalty is not None:
            if self.repetition_penalty is not None and self.repetition_penalty != self.repeat_penalty:
                raise ValueError("repeat_penalty and repetition_penalty differ: give one")
            self.repetition_penalty, self.repeat_penalty = self.repeat_penalty, None
        return self

    def top_logprobs_asked(self) -> int | None:
        """How many top log-probabilities a step the request asks for (None: none at all)."""
        return None


class CompletionRequest(OpenAIRequest):
    prompt: str = Field(min_length=1)
    echo: bool = False                    # the prompt before the completion (with logprobs: its tokens' too)
    logprobs: int | None = Field(default=None, ge=0)   # the top K a step (0: the chosen token's only)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _count(cls, v):
        if v is True:
            raise ValueError("an integer on /v1/completions: how many top log-probabilities a step (0 or more)")
        return None if v is False else v             # false: none, as null

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs
    best_of: Literal[1] | None = None
    suffix: None = None


class ContentPart(Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise ValueError(f"content part type {self.type!r} is not supported (text parts only)")
        return self


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def plain(self) -> dict:
        """-> {role, content} for the chat template: developer is the system role of newer models; text
        parts are joined as the OpenAI API joins them."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None          # true: the chosen token's log-probability a step
    top_logprobs: int | None = Field(default=None, ge=0)   # with logprobs: true, the top K a step beside it

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v, info):
        if v is not None and info.data.get("logprobs") is not True:
            raise ValueError("only allowed with logprobs: true")
        return v

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ: give one")
            self.max_tokens = self.max_completion_tokens
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# OpenAI fields llorch-ref does not implement: refused by name, never ignored
OPENAI_UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                      "modalities", "prediction", "reasoning_effort", "service_tier", "store", "metadata",
                      "web_search_options", "name", "tool_calls", "tool_call_id", "refusal"}
