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
from server.api.protocol import ModelCard, ModelList
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
    token = state.core.model_config.bos_token_id or 0
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
    from engine.quant.module import quantized_formats

    state = get_state(request)
    core, cfg, settings = state.core, state.engine.config, state.settings
    graphs = core.runner.graphs
    return {
        "model": state.model_name,
        "model_path": cfg.model,
        # What smg reads from here for a generic worker (its `ServerInfo`, deserialized with serde: every field
        # optional, a wrong type loses them all; model_gateway/src/workflow/steps/local/discover_metadata.rs).
        # It becomes the worker's labels: served_model_name names the model it routes to the worker,
        # max_running_requests (below) feeds its capacity tracker (model_gateway/src/worker/capacity.rs). "model"
        # is its alias of `model_id`: there must be no "model_id" key beside it (serde: duplicate field).
        "served_model_name": state.model_name,
        "context_length": core.max_context,
        "max_total_tokens": core.runner.kv_pool.num_slots,
        "version": _version("ember"),
        "architecture": core.model_config.architecture,
        "dtype": core.runner.config.dtype,  # --dtype auto resolved for the checkpoint
        "max_context_len": core.max_context,
        "kv_pool_slots": core.runner.kv_pool.num_slots,
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "prefix_cache": not cfg.disable_prefix_cache,
        "decode_buckets": list(graphs.buckets),
        "compiled": graphs.compiled,
        # Buckets ready to run now (with --compile-in-background the rest are still compiling, largest first).
        "compiled_buckets": graphs.ready_buckets if graphs.compiled else [],
        "compile_seconds": {str(b): round(s, 3) for b, s in dict(graphs.compile_seconds).items()},
        "isa": {"active": native.active_isa(), "supported": list(native.SUPPORTED_ISAS),
                "packed_linear": core.runner.model.packed,
                "linear_q": str(torch.ops.ember.linear_q_variant(native.active_isa())) if native.NATIVE_OPS else None,
                "linear_gguf": (str(torch.ops.ember.linear_gguf_variant(native.active_isa())) if native.NATIVE_OPS
                                else None)},
        # Bytes the weights hold in memory, beside the checkpoint's weight files on disk (a GGUF's header included).
        "weights": {"resident_bytes": core.runner.weight_bytes, "file_bytes": core.runner.file_bytes},
        # --quantization, the weights' form (EngineConfig.weights_tag) and each quantized format's weight count
        "quantization": {"mode": cfg.quantization, "weights": core.runner.weights_tag,
                         "formats": quantized_formats(core.runner.model)},
        # The parser reads tool calls in this format; "auto" picks it from the chat template per request.
        "structured_outputs": {"backend": "llguidance", "tool_call_parser": settings.tool_call_parser or "auto",
                               "cached_grammars": core.grammars.cached()},
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
    return load_snapshot(state.core, state.engine.config.max_running_requests, state.throughput,
                         _version("ember") or "unknown")


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=int(state.started_at), root=state.engine.config.model,
                     max_model_len=state.core.max_context)


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
    return {"flushed_slots": freed, "cached_slots": state.core.scheduler.kvm.cached_slots()}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
