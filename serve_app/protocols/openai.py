"""OpenAI-compatible completion and chat completion APIs: request and response models."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

MAX_N = 8  # choices per prompt: each is a full generation, so the cap bounds one request's cost


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage so far in every chunk (vLLM's extension)")


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, description="up to 4 sequences where generation stops")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    # Extensions vLLM's OpenAI server also takes.
    top_k: int = Field(0, ge=0, description="sample from the k likeliest tokens only; 0: no cut")
    ignore_eos: bool = Field(False, description="generate max_tokens tokens even past end-of-sequence")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt (with a seed, choice i uses seed + i)")
    user: str | None = None

    def sampling(self, choice: int = 0, priority: str = "normal") -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": stop,
            "seed": None if self.seed is None else self.seed + choice,
            "ignore_eos": self.ignore_eos,
            "priority": priority,
        }

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def usage_per_chunk(self) -> bool:
        # A chunk may carry several tokens (a slow reader's stream is coalesced); this says how many.
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(description="one prompt, or several (each gets n choices)")


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens; wins when both are set")

    def sampling(self, choice: int = 0, priority: str = "normal") -> dict[str, Any]:
        params = super().sampling(choice, priority)
        if self.max_completion_tokens is not None:
            params["max_tokens"] = self.max_completion_tokens
        return params

    def prompt(self) -> str:
        """The demo generator is a plain language model: the conversation becomes one prompt, one
        `role: content` line per message, ending where the assistant's reply begins."""
        lines = [f"{m.role}: {m.content}" for m in self.messages]
        return "\n".join([*lines, "assistant:"])


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "serve-app"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
