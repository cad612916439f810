"""POST /v1/embeddings (OpenAI's shape) for the served model.

Each input is one prefill-only engine request (EngineClient.embed): the scheduler runs it in the same steps as the
decoding requests, on the same weights, and returns its prompt's final hidden states pooled (mean, or the last
token for decoder embedding models; engine/loader/pooling.py) and L2-normalised. `dimensions` keeps the first
that many components and normalises again (what Matryoshka-trained models such as Qwen3-Embedding expect);
`encoding_format: base64` is the little-endian float32 bytes, which the openai SDK decodes with numpy.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from server.api.deps import check_model, get_state
from server.api.errors import APIError
from server.api.generation import check_admission, unless_disconnected
from server.api.prompts import encode, in_tokenizer_thread

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # a string, a list of strings, a list of token ids, or a list of lists of token ids
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    raw = body.input
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise APIError(400, "input must not be empty", param="input", code="invalid_value")
    if all(isinstance(x, int) for x in raw):
        return [list(raw)]  # type: ignore[arg-type]
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request", param="input", code="invalid_value")
    return list(raw)  # type: ignore[arg-type]


def _shape(vector: tuple[float, ...], dimensions: int | None, encoding: str) -> list[float] | str:
    values = list(vector)
    if dimensions is not None:
        values = values[:dimensions]
        norm = sum(v * v for v in values) ** 0.5 or 1.0
        values = [v / norm for v in values]
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    state = get_state(request)
    check_model(state, body.model)
    hidden = state.engine.info.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise APIError(400, f"dimensions must be at most {hidden}, this model's embedding size", param="dimensions",
                       code="invalid_value")
    tok = state.core.tokenizer
    prompts = [await in_tokenizer_thread(state, encode, tok, x) if isinstance(x, str) else x for x in _inputs(body)]
    check_admission(state, prompts, None)  # SamplingParamsError -> 400 (its handler), 503s
    request_id = f"embd-{uuid.uuid4().hex}"
    state.begin(request_id, len(prompts))
    try:
        jobs = [state.engine.embed(f"{request_id}-{i}", ids) for i, ids in enumerate(prompts)]
        outs = await unless_disconnected(request, asyncio.gather(*jobs))
    finally:
        state.end(request_id)
    data = [Embedding(index=i, embedding=_shape(o.embedding or (), body.dimensions, body.encoding_format))
            for i, o in enumerate(outs)]
    tokens = sum(map(len, prompts))
    return EmbeddingResponse(data=data, model=state.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
