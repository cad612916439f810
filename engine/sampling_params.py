"""Per-request sampling settings, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.params_error import SamplingParamsError

if TYPE_CHECKING:
    from engine.grammar.spec import GrammarSpec

# Temperatures below this sample greedily (as vLLM): the tempered distribution is already a point mass to float32
# precision, and dividing by a much smaller one can overflow to inf and give NaN weights.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # constrain the output (structured outputs, forced tool calls)

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (disabled) or non-negative"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (self.n >= 1, "n", "must be at least 1"),
            (all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise SamplingParamsError(f"{name} {why}", name)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens must not exceed max_tokens", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that edits or reports the logits: the next token is the plain argmax."""
        return (self.greedy and self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0
                and self.presence_penalty == 0.0 and not self.logit_bias and not self.logprobs
                and self.top_logprobs == 0)
