"""Native APIs: SGLang-style POST /generate, vLLM-style POST /v1/tokenize and POST /v1/detokenize."""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.grammar.spec import GrammarSpec
from engine.sampling_params import SamplingParams
from server.api.deps import check_model, get_state
from server.api.errors import APIError
from server.api.generation import TaggedOutputs, check_admission, generate, merge, unless_disconnected
from server.api.openai_format import ChoiceResult, clamp
from server.api.prompts import (
    encode,
    in_tokenizer_thread,
    message_dicts,
    render_chat,
    sampling_defaults,
    sampling_params,
)
from server.api.protocol import SamplingFields
from server.api.protocol_native import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateMeta,
    GenerateRequest,
    GenerateResponse,
    NativeSamplingParams,
    TokenizeRequest,
    TokenizeResponse,
)
from server.api.request_fields import check_and_log_request_fields
from server.api.sse import DONE, HEADERS, EventStreamResponse, error_event
from server.api.state import ServerState
from server.api.structured import compile_grammar, native_grammar

router = APIRouter()


def _params(sp: NativeSamplingParams, body: GenerateRequest, max_n: int,
            grammar: GrammarSpec | None, defaults: dict[str, float]) -> SamplingParams:
    fields = SamplingFields(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, n=sp.n, stop=sp.stop,
        seed=sp.seed, presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, min_tokens=sp.min_new_tokens, ignore_eos=sp.ignore_eos,
        stop_token_ids=sp.stop_token_ids, skip_special_tokens=sp.skip_special_tokens, logit_bias=sp.logit_bias,
    )
    return sampling_params(fields, sp.max_new_tokens, logprobs=body.return_logprob,
                           top_logprobs=body.top_logprobs_num, max_n=max_n, grammar=grammar, defaults=defaults)


async def _prompts(state: ServerState, body: GenerateRequest) -> list[list[int]]:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        return [await in_tokenizer_thread(state, encode, state.core.tokenizer, t) for t in texts]
    ids = body.input_ids or []
    if all(isinstance(t, int) for t in ids):
        return [[int(t) for t in ids]] if ids else []  # type: ignore[arg-type]
    return [list(p) for p in ids if isinstance(p, list)]


def _result(rid: str, prompt_tokens: int, r: ChoiceResult, ids: list[int], logprobs: bool) -> GenerateResponse:
    finish = None if r.finish_reason is None else {"type": r.finish_reason, "matched": r.stop_reason}
    meta = GenerateMeta(id=rid, prompt_tokens=prompt_tokens, completion_tokens=r.completion_tokens,
                        cached_tokens=r.cached_tokens, finish_reason=finish, spec_proposed_tokens=r.spec_proposed,
                        spec_accepted_tokens=r.spec_accepted)
    if logprobs:
        meta.output_token_logprobs = [(clamp(lp.logprob), lp.token_id, None) for lp in r.logprobs]
        meta.output_top_logprobs = [[(clamp(v), t, None) for t, v in lp.top] for lp in r.logprobs]
    return GenerateResponse(text=r.text, output_ids=ids, meta_info=meta)


@router.post("/generate", response_model=None)
async def native_generate(body: GenerateRequest, request: Request) -> Response:
    state = get_state(request)
    check_and_log_request_fields(body, "generate")
    sp = body.sampling_params
    grammar = native_grammar(sp.json_schema, sp.regex, sp.ebnf)
    params = _params(sp, body, state.settings.max_n, grammar, sampling_defaults(state))  # as SGLang's "model" defaults
    prompts = await _prompts(state, body)
    if not prompts:
        raise APIError(400, "no prompt given", param="text")
    if params.n * len(prompts) > state.settings.max_n:
        raise APIError(400, f"n times the number of prompts must be at most {state.settings.max_n}", param="n")
    await compile_grammar(state, grammar)
    check_admission(state, prompts, params)
    base = body.rid or uuid.uuid4().hex
    rids = [base] if len(prompts) == 1 else [f"{base}-{k}" for k in range(len(prompts))]
    outputs = merge([generate(state, rid, p, params) for rid, p in zip(rids, prompts, strict=True)])
    single = len(prompts) * params.n == 1

    def choice_id(prompt_idx: int, index: int) -> str:
        return rids[prompt_idx] if params.n == 1 else f"{rids[prompt_idx]}/{index}"

    if body.stream:
        return EventStreamResponse(_stream(outputs, prompts, params, choice_id, single), headers=HEADERS)

    async def collect() -> dict[tuple[int, int], tuple[ChoiceResult, list[int]]]:
        acc: dict[tuple[int, int], tuple[ChoiceResult, list[int]]] = {}
        async with aclosing(outputs) as outs:
            async for p, out in outs:
                r, ids = acc.setdefault((p, out.index), (ChoiceResult(), []))
                r.add(out)
                ids.extend(out.token_ids)
        return acc

    acc = await unless_disconnected(request, collect())
    results = [_result(choice_id(p, i), len(prompts[p]), r, ids, params.logprobs).model_dump()
               for (p, i), (r, ids) in sorted(acc.items())]
    return JSONResponse(results[0] if single else results)


async def _stream(outputs: TaggedOutputs, prompts: list[list[int]], params: SamplingParams,
                  choice_id: Callable[[int, int], str], single: bool) -> AsyncGenerator[str, None]:
    """SGLang's streaming format: each event carries the text and ids so far (cumulative), then [DONE]."""
    acc: dict[tuple[int, int], tuple[ChoiceResult, list[int]]] = {}
    try:
        async with aclosing(outputs) as outs:
            async for p, out in outs:
                r, ids = acc.setdefault((p, out.index), (ChoiceResult(), []))
                r.add(out)
                ids.extend(out.token_ids)
                payload = _result(choice_id(p, out.index), len(prompts[p]), r, ids, params.logprobs).model_dump()
                if not single:
                    payload["index"] = p * params.n + out.index
                yield f"data: {json.dumps(payload)}\n\n"
    except Exception as exc:  # the 200 is out: report in-band
        yield error_event(exc)
    yield DONE


@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = get_state(request)
    check_model(state, body.model)
    tok = state.core.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        ids = await in_tokenizer_thread(state, render_chat, tok, message_dicts(body.messages),
                                        body.add_generation_prompt)
    else:
        ids = await in_tokenizer_thread(state, encode, tok, body.prompt or "", body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.info.max_context, tokens=ids)


@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = get_state(request)
    check_model(state, body.model)
    vocab = state.engine.info.model_config.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    text = await in_tokenizer_thread(state, state.core.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=str(text))
