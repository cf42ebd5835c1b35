"""Token sampling and incremental detokenization for the generator (pure numpy)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve_app.errors import InvalidInput


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 32
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating past EOS (vLLM's extension; benchmarks use it for exact lengths)

    @classmethod
    def from_raw(cls, raw: dict[str, Any], default_max_tokens: int, max_tokens_limit: int) -> GenerationParams:
        """From a request's sampling parameters (OpenAI's fields, or v2's `parameters`), every one
        type-checked and range-checked: a bad value is the caller's 400, never a failed decode step."""
        stop = raw.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise InvalidInput("stop must be a string or a list of strings")
        seed = raw.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise InvalidInput(f"seed must be an integer in [0, 2**63), got {seed!r}")
        ignore_eos = raw.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise InvalidInput(f"ignore_eos must be true or false, got {ignore_eos!r}")
        params = cls(
            max_tokens=_number(raw.get("max_tokens") or default_max_tokens, "max_tokens", int),
            temperature=_number(raw.get("temperature", 0.0), "temperature", float),
            top_p=_number(raw.get("top_p", 1.0), "top_p", float),
            top_k=_number(raw.get("top_k", 0), "top_k", int),
            seed=seed,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
        )
        params.validate(max_tokens_limit)
        return params

    def validate(self, max_tokens_limit: int) -> None:
        if not 1 <= self.max_tokens <= max_tokens_limit:
            raise InvalidInput(f"max_tokens must be between 1 and {max_tokens_limit}, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidInput(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0, got {self.top_k}")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise InvalidInput("stop takes at most 4 non-empty strings")


def _number(value: Any, name: str, kind: type[int] | type[float]) -> Any:
    """An int or float parameter; bools, strings, NaN and infinities are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise InvalidInput(f"{name} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise InvalidInput(f"{name} must be an integer, got {value!r}")
    return kind(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (JSON allows integers of any length)
        return False


def sample(logits: np.ndarray, params: GenerationParams, rng: np.random.Generator) -> int:
    """Pick the next token from (V,) logits."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    # The largest logit is taken away before dividing: a tiny temperature then sends the others
    # to -inf (greedy in effect) instead of every logit to inf, whose difference is NaN.
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # the overflow to -inf is the point
        z = (z - z.max()) / params.temperature
    k = min(params.top_k, len(z))  # a cut wider than the vocabulary keeps every token
    if k:
        kth = np.partition(z, -k)[-k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]  # smallest set reaching top_p
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(len(p), p=p))


class StreamingText:
    """Turns a growing token list into text deltas that are safe to send.

    Holds back an incomplete UTF-8 character (byte-level BPE can split one) and
    any tail that could still become a stop string, so a client never sees
    text that a later token takes back.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def update(self, full_text: str) -> str:
        self.text = full_text
        # One token can complete several stop strings: the text ends before the first of them.
        cuts = [i for s in self.stop if (i := full_text.find(s)) != -1]
        if cuts:
            self.text = full_text[: min(cuts)]
            self.stopped = True
        if self.stopped:
            return self.flush()
        safe = len(full_text)
        if full_text.endswith("\ufffd"):
            safe -= 1
        safe -= _stop_prefix_tail(full_text[:safe], self.stop)
        if safe <= self.emitted:
            return ""
        delta = full_text[self.emitted : safe]
        self.emitted = safe
        return delta

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


def _stop_prefix_tail(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
