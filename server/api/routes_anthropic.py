"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

A request is mapped onto a chat completion request (server/api/anthropic_format.py) and goes through the chat
route's own steps: tool planning (template tools, parser, forced-call grammar), the chat template, sampling
parameters, admission. So a prompt renders, and a tool call is forced and parsed, exactly as in chat. With a
reasoning parser (server/api/reasoning.py) the reasoning is a `thinking` block ahead of the answer's blocks (none
with `thinking: {"type": "disabled"}`), a forced call constrains the answer only, and calls are read from it.
Errors on these routes are in Anthropic's shape (server/api/errors.py).

A model name starting with `claude-` is served by the served model and echoed in the response's `model`: Claude
Code (and other Anthropic clients) send their own model names and offer no way to name a local one, so a strict
check would make them unusable; llama-server's and Ollama's Anthropic endpoints answer such names the same way.
Any other name but the served one is still a 404.
"""
from __future__ import annotations

import uuid
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.anthropic_format import as_chat_request, content_blocks, stop_reason
from server.api.anthropic_stream import MessageSpec, message_events
from server.api.chat_tools import ToolPlan, message_parts
from server.api.deps import check_model, get_state
from server.api.generation import check_admission, unless_disconnected
from server.api.prompts import in_tokenizer_thread, render_chat_prompt, sampling_defaults, sampling_params
from server.api.protocol import ChatCompletionRequest
from server.api.protocol_anthropic import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    Usage,
)
from server.api.reasoning import CLOSE, ReasoningParser, grammar_prefix, prompt_start
from server.api.request_fields import check_and_log_request_fields
from server.api.routes_chat import _plan, reasoning_parser_for
from server.api.routes_openai import collect, streams
from server.api.sse import HEADERS, EventStreamResponse
from server.api.state import ServerState
from server.api.structured import compile_grammar

router = APIRouter()
_ANTHROPIC_MODELS = "claude-"


def _model(state: ServerState, requested: str | None) -> str:
    """The model name the response names: a `claude-*` name as requested, else the served one (raises a 404 for
    another name)."""
    if requested is not None and requested.startswith(_ANTHROPIC_MODELS):
        return requested
    check_model(state, requested)
    return state.model_name


async def _prompt(state: ServerState,
                  body: CountTokensRequest) -> tuple[ChatCompletionRequest, ToolPlan, list[int], str]:
    """(the chat request, its tool plan, prompt ids, prompt text), rendered as chat renders them. Raises APIError
    (400/404). Fields Ember does not serve are refused or logged as ignored by their RULES."""
    check_and_log_request_fields(body, "messages")
    _model(state, body.model)
    chat = as_chat_request(body)
    plan = await _plan(state, chat)
    prompt, text = await in_tokenizer_thread(state, render_chat_prompt, state.core.tokenizer, plan.messages, True,
                                             plan.template_tools, None)
    return chat, plan, prompt, text


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> CountTokensResponse:
    _, _, prompt, _ = await _prompt(get_state(request), body)
    return CountTokensResponse(input_tokens=len(prompt))


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response | MessageResponse:
    state = get_state(request)
    chat, plan, prompt, prompt_text = await _prompt(state, body)
    start = prompt_start(prompt_text) if reasoning_parser_for(state) is not None else None
    include = body.thinking is None or body.thinking.type != "disabled"
    grammar = plan.grammar
    if grammar is not None and start is not None and CLOSE not in grammar.source:  # as chat: the answer only
        grammar = replace(grammar, prefix=grammar_prefix(start))
    params = sampling_params(chat, body.max_tokens, logprobs=False, top_logprobs=0, max_n=state.settings.max_n,
                             grammar=grammar, defaults=sampling_defaults(state))
    if plan.keep_special_tokens:
        params = replace(params, skip_special_tokens=False)
    await compile_grammar(state, grammar)
    check_admission(state, [prompt], params)
    message_id = f"msg_{uuid.uuid4().hex}"
    outputs = streams(state, message_id, [prompt], params)
    parallel = chat.parallel_tool_calls is not False
    if body.stream:
        spec = MessageSpec(message_id, _model(state, body.model), len(prompt), body.stop_sequences, plan.parser, parallel,
                           start, include)
        return EventStreamResponse(message_events(spec, outputs), headers=HEADERS)
    r = (await unless_disconnected(request, collect(outputs, 1, 1)))[0]
    thought, answer = (None, r.text) if start is None else ReasoningParser(start).split(r.text)
    text, calls = message_parts(plan.parser, answer, parallel)  # tool calls are read from the answer only
    reason, sequence = stop_reason(r.finish_reason, r.stop_reason, body.stop_sequences, bool(calls))
    blocks = content_blocks(text, calls, thought if include else None)
    return MessageResponse(id=message_id, model=_model(state, body.model), content=blocks,
                           stop_reason=reason, stop_sequence=sequence,
                           usage=Usage(input_tokens=len(prompt) - r.cached_tokens, output_tokens=r.completion_tokens,
                                       cache_read_input_tokens=r.cached_tokens))
