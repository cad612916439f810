"""HTTP-side settings (the engine's live in engine/config.py): one frozen dataclass, built once by `ember serve`."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # 8 MiB: room for a long prompt as JSON token ids, far from memory trouble


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    served_model_name: str | None = None  # None: the model's own name (folder name or GGUF stem)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_n: int = 16  # most choices one request may ask for (n, and n times the number of prompts)
    shutdown_grace_seconds: float = 30.0  # SIGTERM: how long running requests may finish before being aborted
    retry_after_seconds: int = 1  # what a 503 tells the client to wait
    log_level: str = "info"
    tool_call_parser: str | None = None  # None: chosen from the chat template (server/api/tool_parsers.py)
    # "vllm": /metrics also exports vLLM's names for the gauges load-aware routers read (server/api/metrics.py)
    metrics_compat: str | None = None
    reasoning_parser: str | None = None  # None: chosen from the chat template (server/api/reasoning.py)
    # "auto": a request's unset sampling fields take the model's recommended values (generation_config.json, GGUF
    # general.sampling.*), then `sampling_overrides` (the config file's [sampling] table) over those; "none":
    # OpenAI's defaults (temperature 1, no top-p/top-k/min-p), the overrides still applying.
    generation_config: str = "auto"
    sampling_overrides: tuple[tuple[str, float], ...] = ()
    responses_store_size: int = 1000  # stored /v1/responses kept for previous_response_id (an LRU; 0: none)

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        if self.max_n < 1:
            raise ValueError("max_n must be at least 1")
        if self.shutdown_grace_seconds < 0:
            raise ValueError("shutdown_grace_seconds must be non-negative")
        if self.metrics_compat not in (None, "vllm"):
            raise ValueError("metrics_compat must be None or 'vllm'")
        if self.generation_config not in ("auto", "none"):
            raise ValueError("generation_config must be 'auto' or 'none'")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must be non-negative")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
