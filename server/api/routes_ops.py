"""Operations endpoints: GET /health, /health_generate, /get_server_info, /v1/loads, /v1/models, /v1/models/{id},
/metrics, and the admin route POST /flush_cache.

A router sees Ember as a generic OpenAI-compatible worker: smg classes a worker as SGLang or vLLM by /v1/models'
`owned_by` ("ember" is neither) and by whether /server_info (SGLang) or /version (vLLM) answer, so Ember serves
neither of those two paths (model_gateway/src/workflow/steps/local/detect_backend.rs in smg).

/health and /metrics never touch the engine thread's locks or the tokenizer: they must answer in well under
100 ms while a decode batch runs, and before the engine has finished loading.
"""
from __future__ import annotations

import asyncio
import platform
import uuid
from contextlib import aclosing
from functools import cache
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import SamplingParams
from server.api.deps import get_state
from server.api.errors import APIError, error_response
from server.api.loads import SECTIONS, WorkerLoads, include_is_valid, load_snapshot
from server.api.metrics import CONTENT_TYPE
from server.api.prompts import OPENAI_SAMPLING, sampling_defaults
from server.api.protocol import ModelCard, ModelList
from server.api.routes_chat import reasoning_parser_for
from server.api.state import ServerState

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 30.0


@router.get("/health")
async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.draining:
        return error_response(503, "the server is shutting down", code="draining")
    if not state.engine.ready:
        failed = state.engine.error is not None
        return error_response(503, "the engine has failed (see the server log)" if failed
                              else "the engine is still loading", code="engine_failed" if failed else "loading")
    return JSONResponse({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token through the real engine: proves the engine thread is alive and stepping."""
    state = get_state(request)
    if state.draining:
        return error_response(503, "the server is shutting down", code="draining")
    token = state.engine.info.model_config.bos_token_id or 0
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def one_token() -> None:
        async with aclosing(state.engine.generate(f"health-{uuid.uuid4().hex}", [token], params)) as outs:
            async for _ in outs:
                pass

    try:
        await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return error_response(503, f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", code="engine_stalled")
    return JSONResponse({"status": "ok"})


@cache  # installed versions do not change while we run, and /v1/loads asks on every poll
def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    import torch

    from engine.ops import native  # loaded by the engine already; not at import (keeps `ember --help` light)

    state = get_state(request)
    info, stats, cfg, settings = state.engine.info, state.engine.stats, state.engine.config, state.settings
    return {
        "model": state.model_name,
        "model_path": cfg.model,
        # What smg reads from here for a generic worker (its `ServerInfo`, deserialized with serde: every field
        # optional, a wrong type loses them all; model_gateway/src/workflow/steps/local/discover_metadata.rs).
        # It becomes the worker's labels: served_model_name names the model it routes to the worker,
        # max_running_requests (below) feeds its capacity tracker (model_gateway/src/worker/capacity.rs). "model"
        # is its alias of `model_id`: there must be no "model_id" key beside it (serde: duplicate field).
        "served_model_name": state.model_name,
        "context_length": info.max_context,
        "max_total_tokens": info.kv_slots,
        "version": _version("ember"),
        "architecture": info.model_config.architecture,
        "dtype": cfg.dtype,  # --dtype auto resolved
        "max_context_len": info.max_context,
        "kv_pool_slots": info.kv_slots,
        # The KV cache's storage (--kv-cache-dtype) and one token's bytes in the pool (int8: scales included)
        "kv_cache": {"dtype": info.kv_dtype, "bytes_per_token": info.kv_bytes_per_token,
                     # sliding-window layers' own slots (docs/prefix-cache.md): how many, a token's bytes there
                     **({"window_slots": info.window_slots, "window_bytes_per_token": info.window_bytes_per_token,
                         "window_slots_used": stats.window_used_slots} if info.window_slots else {})},
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "prefix_cache": not cfg.disable_prefix_cache,
        # The prefix cache's disk tier: its size limit (MiB, 0 = off) and what it holds and served so far
        "kv_disk_cache": {"size_mib": cfg.kv_disk_cache_size, "enabled": stats.kv_disk is not None,
                          **({"bytes": stats.kv_disk.bytes, "hit_tokens": stats.kv_disk.hit_tokens,
                              "written_bytes": stats.kv_disk.written_bytes} if stats.kv_disk is not None else {})},
        "decode_buckets": list(info.decode_buckets),
        "compiled": info.compiled,
        # Buckets ready to run now (with --compile-in-background the rest are still compiling, largest first).
        "compiled_buckets": list(stats.ready_buckets),
        # Still compiling in the background; false once every bucket is in, or the rest are left eager (no memory
        # for a compile child, see the log)
        "compiling": state.engine.compiling,
        "compile_seconds": {str(b): round(s, 3) for b, s in stats.compile_seconds},
        # How each ready bucket got there: "loaded" (a saved step), "compiled" (in this process), "compile child"
        "bucket_sources": {str(b): how for b, how in stats.bucket_sources},
        "isa": {"active": native.active_isa(), "supported": list(native.SUPPORTED_ISAS),
                "packed_linear": info.packed_linear,
                "linear_q": str(torch.ops.ember.linear_q_variant(native.active_isa())) if native.NATIVE_OPS else None,
                "linear_gguf": (str(torch.ops.ember.linear_gguf_variant(native.active_isa())) if native.NATIVE_OPS
                                else None)},
        # Bytes the weights hold in memory, beside the checkpoint's weight files on disk (a GGUF's header included).
        "weights": {"resident_bytes": info.weight_bytes, "file_bytes": info.file_bytes},
        # --quantization, the weights' form (EngineConfig.weights_tag) and each quantized format's weight count
        "quantization": {"mode": cfg.quantization, "weights": info.weights_tag,
                         "formats": dict(info.quantized_formats)},
        # The parser reads tool calls in this format; "auto" picks it from the chat template per request.
        "structured_outputs": {"backend": "llguidance", "tool_call_parser": settings.tool_call_parser or "auto",
                               "cached_grammars": stats.cached_grammars},
        # The <think> parser of chat outputs ("none": reasoning stays in the content), and the values a request's
        # unset sampling fields take (--generation-config, the config file's [sampling] table)
        "reasoning_parser": reasoning_parser_for(state) or "none",
        "sampling_defaults": {**OPENAI_SAMPLING, **sampling_defaults(state)},
        # /v1/embeddings: how hidden states are pooled (--pooling, or the model folder's) and the vectors' length
        "embeddings": {"pooling": info.pooling, "dimensions": info.hidden_size},
        # Speculative decoding: the drafter ("off" also for models that cannot draft), the draft cap, and so far
        "speculative": {"mode": info.speculative, "num_speculative_tokens": cfg.num_speculative_tokens,
                        "draft_model": cfg.draft_model, "draft_compiled_buckets": stats.draft_ready_buckets,
                        "proposed_tokens": stats.spec_proposed_tokens, "accepted_tokens": stats.spec_accepted_tokens,
                        "verify_steps": stats.spec_verify_steps,
                        # the measured ms of a decode step per bucket, what drafting into a bigger one is weighed by
                        "step_ms": {str(b): round(secs * 1e3, 3) for b, secs in stats.spec_step_seconds}},
        "max_n": settings.max_n,
        "max_request_bytes": settings.max_request_bytes,
        "auth": settings.api_key is not None,
        "versions": {"ember": _version("ember"), "torch": _version("torch"),
                     "transformers": _version("transformers"),
                     "llguidance": _version("llguidance"), "python": platform.python_version()},
    }


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None) -> WorkerLoads:
    """The engine's load in the shape smg polls from a generic worker (server/api/loads.py). `include` takes
    SGLang's section names (smg sends core,disagg,queues,memory); Ember answers the core fields for any of them."""
    state = get_state(request)
    if not include_is_valid(include):
        raise APIError(400, f"include must be a comma-separated list of {', '.join(sorted(SECTIONS))}",
                       param="include", code="invalid_value")
    return load_snapshot(state.engine.info, state.engine.stats, state.throughput, _version("ember") or "unknown")


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=int(state.started_at), root=state.engine.config.model,
                     max_model_len=state.engine.info.max_context)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(get_state(request))])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> ModelCard:
    state = get_state(request)
    if model_id != state.model_name:
        raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
    return _card(state)


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, int]:
    """SGLang's admin route: drop the prefix cache. Entries that running requests use stay (they are in use)."""
    state = get_state(request)
    freed = await state.engine.flush_cache()
    return {"flushed_slots": freed, "cached_slots": state.engine.stats.prefix_cache_slots}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
