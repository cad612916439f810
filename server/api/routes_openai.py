"""OpenAI-compatible legacy completions: POST /v1/completions (chat lives in routes_chat.py)."""
from __future__ import annotations

import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.sampling_params import SamplingParams
from server.api.deps import check_model, get_state
from server.api.errors import APIError
from server.api.generation import TaggedOutputs, check_admission, generate, merge, unless_disconnected
from server.api.openai_format import ChoiceResult, CompletionLogprobsBuilder, TokenStrings, usage
from server.api.openai_stream import StreamSpec, completion_events, usage_options
from server.api.prompts import encode, in_tokenizer_thread, sampling_defaults, sampling_params, split_prompts
from server.api.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from server.api.request_fields import check_and_log_request_fields
from server.api.sse import HEADERS, EventStreamResponse
from server.api.structured import compile_grammar, request_grammar
from server.api.state import ServerState

router = APIRouter()


def streams(state: ServerState, request_id: str, prompts: list[list[int]],
             params: SamplingParams) -> TaggedOutputs:
    """One engine request per prompt (ids `<id>` or `<id>-<k>`), merged; choice index = prompt * n + choice."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
    return merge([generate(state, rid, p, params) for rid, p in zip(ids, prompts, strict=True)])


async def collect(outputs: TaggedOutputs, n: int, choices: int) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(choices)]
    async with aclosing(outputs) as outs:
        async for prompt_idx, out in outs:
            results[prompt_idx * n + out.index].add(out)
    return results


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
    state = get_state(request)
    check_and_log_request_fields(body, "completions")
    check_model(state, body.model)
    grammar = request_grammar(body)
    params = sampling_params(body, body.max_tokens, logprobs=body.logprobs is not None,
                             top_logprobs=body.logprobs or 0, max_n=state.settings.max_n, grammar=grammar,
                             defaults=sampling_defaults(state))
    raw = split_prompts(body.prompt)
    if params.n * len(raw) > state.settings.max_n:
        raise APIError(400, f"n times the number of prompts must be at most {state.settings.max_n} (--max-n)",
                       param="n")
    tok = state.core.tokenizer
    prompts = [await in_tokenizer_thread(state, encode, tok, p) if isinstance(p, str) else p for p in raw]
    await compile_grammar(state, grammar)
    check_admission(state, prompts, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    strings = TokenStrings(tok)
    echo = None
    if body.echo:
        echo = [(p if isinstance(p, str) else str(tok.decode(ids)), ids) for p, ids in zip(raw, prompts, strict=True)]
    outputs = streams(state, request_id, prompts, params)
    if body.stream:
        include_usage, continuous = usage_options(body.stream_options)
        spec = StreamSpec(request_id, state.model_name, params.n, sum(map(len, prompts)), include_usage,
                          params.logprobs, continuous_usage=continuous)
        return EventStreamResponse(completion_events(spec, outputs, strings, echo), headers=HEADERS)
    results = await unless_disconnected(request, collect(outputs, params.n, params.n * len(prompts)))
    choices = []
    for index, r in enumerate(results):
        prompt_text, prompt_ids = echo[index // params.n] if echo is not None else ("", [])
        lps = CompletionLogprobsBuilder(strings).add(r.logprobs, prompt_ids) if params.logprobs else None
        choices.append(CompletionChoice(index=index, text=prompt_text + r.text, logprobs=lps,
                                        finish_reason=r.finish_reason, stop_reason=r.stop_reason))
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                              usage=usage(sum(map(len, prompts)), sum(r.completion_tokens for r in results),
                                          sum(r.cached_tokens for r in results[:: params.n])))
