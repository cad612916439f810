"""POST /v1/chat/completions: the chat template, structured outputs, and tool calls in and out."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.chat_tools import ToolPlan, finish_reason, message_parts, plan_tools
from server.api.deps import check_model, get_state
from server.api.errors import APIError
from server.api.generation import check_admission, unless_disconnected
from server.api.openai_format import TokenStrings, chat_logprobs, usage
from server.api.openai_stream import ReasoningStreaming, StreamSpec, ToolStreaming, chat_events, usage_options
from server.api.prompts import in_tokenizer_thread, render_chat_prompt, sampling_defaults, sampling_params
from server.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    FunctionCallOut,
    ToolCallOut,
)
from server.api.reasoning import CLOSE, ReasoningParser, grammar_prefix, parser_for_template, prompt_start
from server.api.request_fields import check_and_log_request_fields
from server.api.routes_openai import collect, streams
from server.api.sse import HEADERS, EventStreamResponse
from server.api.state import ServerState
from server.api.structured import compile_grammar, request_grammar

router = APIRouter()


async def _plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    args = (body, state.core.tokenizer.chat_template, state.settings.tool_call_parser, state.core.grammars)
    if not body.tools:  # no tool work at all: no hop to another thread on the common path
        return plan_tools(*args)
    # On the grammar thread: the first request with tools builds the grammar tokenizer (~0.5 s).
    return await asyncio.get_running_loop().run_in_executor(state.grammar_pool, plan_tools, *args)


def reasoning_parser_for(state: ServerState) -> str | None:
    """The reasoning parser in force: --reasoning-parser, or the one the chat template calls for (None: none)."""
    return parser_for_template(state.core.tokenizer.chat_template, state.settings.reasoning_parser)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletionResponse:
    state = get_state(request)
    check_and_log_request_fields(body, "chat")
    check_model(state, body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = await _plan(state, body)
    tok = state.core.tokenizer
    thinking = reasoning_parser_for(state)
    if thinking is None and not body.include_reasoning:
        raise APIError(400, "include_reasoning false needs a reasoning parser; this model has none "
                       "(--reasoning-parser)", param="include_reasoning", code="unsupported_field")
    prompt, prompt_text = await in_tokenizer_thread(state, render_chat_prompt, tok, plan.messages,
                                                    body.add_generation_prompt, plan.template_tools,
                                                    body.chat_template_kwargs)
    start = prompt_start(prompt_text) if thinking is not None else None
    grammar = plan.grammar or request_grammar(body)
    # The constraint applies to the answer, after the reasoning; one that spells out `</think>` itself
    # constrains the reasoning too, and is applied as it is.
    if grammar is not None and start is not None and CLOSE not in grammar.source:
        grammar = replace(grammar, prefix=grammar_prefix(start))
    # max_completion_tokens bounds reasoning and answer together: both are completion tokens.
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
                             max_n=state.settings.max_n, grammar=grammar, defaults=sampling_defaults(state))
    if plan.keep_special_tokens:
        params = replace(params, skip_special_tokens=False)
    await compile_grammar(state, grammar)
    check_admission(state, [prompt], params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    strings = TokenStrings(tok)
    outputs = streams(state, request_id, [prompt], params)
    parallel = body.parallel_tool_calls is not False
    if body.stream:
        include_usage, continuous = usage_options(body.stream_options)
        spec = StreamSpec(request_id, state.model_name, params.n, len(prompt), include_usage, params.logprobs,
                          continuous_usage=continuous)
        tools = None if plan.parser is None else ToolStreaming(plan.parser, parallel)
        thoughts = None if start is None else ReasoningStreaming(start, body.include_reasoning)
        return EventStreamResponse(chat_events(spec, outputs, strings, tools, thoughts), headers=HEADERS)
    results = await unless_disconnected(request, collect(outputs, params.n, params.n))
    choices = []
    for i, r in enumerate(results):
        thought, answer = (None, r.text) if start is None else ReasoningParser(start).split(r.text)
        content, calls = message_parts(plan.parser, answer, parallel)  # tool calls are read from the answer only
        message = ChatMessageOut(content=content, reasoning_content=(thought or None) if body.include_reasoning
                                 else None, tool_calls=[
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls])
        choices.append(ChatChoice(
            index=i, message=message,
            logprobs=ChatLogprobs(content=chat_logprobs(strings, r.logprobs)) if params.logprobs else None,
            finish_reason=finish_reason(r.finish_reason, bool(calls)), stop_reason=r.stop_reason))
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=usage(len(prompt), sum(r.completion_tokens for r in results),
                                              results[0].cached_tokens))
