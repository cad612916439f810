"""One sequence being generated: its tokens, sampling settings, place in the pools and timing."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import FinishReason, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.stop import StopChecker


# How an embedding request pools its prompt's final hidden states; None: a generation request.
Pooling = Literal["mean", "last"]


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted, prompt (or recompute) partly in the KV cache
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str  # the client's id; n > 1 choices share it
    index: int  # choice number within the request
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params.max_tokens, or what the context leaves
    detok: IncrementalDetokenizer
    stop: StopChecker
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    req_row: int = 0  # 0 = none (row 0 is the padding row)
    kv_len: int = 0  # tokens of `all_ids` whose K/V sit in the pool at req_to_token[req_row, :kv_len]
    cached_len: int = 0  # of which the first cached_len are prefix-cache slots, locked through cache_node
    cache_node: Any = None  # the RadixCache node this request's cached prefix ends at (engine/kv_manager.py)
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission (reported)
    # Window layers with their own slots (engine/window_slots.py): own positions below window_from gave theirs back;
    # the cached positions [start, end) of window_pinned are pinned (the request's window still reads them)
    window_from: int = 0
    window_pinned: tuple[int, int] = (0, 0)
    # llguidance matcher of params.grammar, advanced by every output token (engine thread only). Retraction keeps
    # output_ids, so the matcher never needs rolling back.
    matcher: Any = None
    # An embedding request is prefill-only: its prompt's final-normed hidden states are pooled (summed chunk by
    # chunk for "mean") into `pooled` and it finishes when the prompt is done, with `embedding` (L2-normalised).
    pooling: Pooling | None = None
    pooled: Any = None  # torch.Tensor [hidden] fp32, engine thread only
    spec: Any = None  # engine/speculative.py SpecState once the request has drafted (engine thread only)
    embedding: tuple[float, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # what the next RequestOutput carries (the engine drains these after each step)
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def rid(self) -> str:
        return f"{self.request_id}/{self.index}"

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        """Tokens that must be in the KV cache before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
