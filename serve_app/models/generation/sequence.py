"""One generation's state, whichever scheduler runs it: tokens, sampler, text stream (pure numpy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve_app.models.generation.sampling import GenerationParams, StreamingText, sample


@dataclass(frozen=True)
class TokenEvent:
    """One decode step's output for one request; the last one has a finish_reason."""

    text: str
    token_id: int | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    tokens: int = 1  # decode steps this event covers (more than one once merged)

    def merge(self, later: TokenEvent) -> TokenEvent:
        """This event and the next of the same sequence as one (a stream that fell behind)."""
        return TokenEvent(
            self.text + later.text,
            later.token_id,
            later.prompt_tokens,
            later.completion_tokens,
            later.finish_reason,
            self.tokens + later.tokens,
        )


@dataclass
class Sequence:
    """A prompt and what has been generated for it.

    The model has seen `cached` tokens of `prompt + tokens` (their keys and values
    are in the KV cache); the rest are `pending` and go through the model at the
    next step: part of the prompt while prefilling, then the one token last sampled.
    """

    id: int
    prompt: list[int]
    params: GenerationParams
    limit: int  # max new tokens, capped by the context window
    priority: int = 1  # lower runs first (serve_app.scheduling.queue.Priority)
    submitted_at: float = 0.0  # monotonic seconds
    arrival: int = 0  # order of arrival at the scheduler: first come, first served within a priority
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    slot: int | None = None
    saved_kv: np.ndarray | None = None  # positions kept while preempted
    finished: bool = False
    cancelled: bool = False  # set from another thread; the scheduler frees the slot at its next step
    submitted_step: int = 0
    first_token_step: int | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    trace: Any = field(default=None, repr=False)  # the context its step spans go under (OpenTelemetry); None untraced
    rng: np.random.Generator = field(init=False)
    text: StreamingText = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)
        self.text = StreamingText(self.params.stop)

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.tokens)

    @property
    def pending(self) -> int:
        return self.context_len - self.cached

    def feed(self, n: int) -> list[int]:
        """The next `n` tokens the model has not seen."""
        start = self.cached
        if start < len(self.prompt):
            return (self.prompt + self.tokens)[start : start + n]
        return self.tokens[start - len(self.prompt) : start - len(self.prompt) + n]

    def advance(self, logits: np.ndarray, eos_id: int, detokenize: Callable[[list[int]], str]) -> TokenEvent:
        """Sample one token from (V,) logits and report the text it adds."""
        tok = sample(logits, self.params, self.rng)
        finish: str | None = None
        if tok == eos_id and not self.params.ignore_eos:
            finish = "stop"
        else:
            self.tokens.append(tok)
            if len(self.tokens) >= self.limit:
                finish = "length"
        delta = self.text.update(detokenize(self.tokens))
        if self.text.stopped:
            finish = "stop"
        if finish:
            delta += self.text.flush()
            self.finished = True
        return TokenEvent(delta, tok, len(self.prompt), len(self.tokens), finish)
