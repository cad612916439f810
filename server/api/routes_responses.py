"""POST /v1/responses (OpenAI's Responses API), stateless or stored, on chat completion's machinery; GET and
DELETE /v1/responses/{id}; GET /v1/responses/{id}/input_items; POST /v1/responses/input_tokens.

A turn is rendered as the chat request it stands for (server/api/responses_input.py) over the whole
conversation: a `previous_response_id`'s stored history and output, then this turn's input. The chat template
renders earlier turns the same way each time, so a chained turn's prompt starts with the previous turn's prompt
and the prefix cache serves that part (`usage.input_tokens_details.cached_tokens`).
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from engine.params_error import SamplingParamsError
from server.api.chat_tools import ToolPlan, message_parts
from server.api.deps import check_model, get_state
from server.api.errors import APIError, from_sampling_error
from server.api.generation import check_admission, unless_disconnected
from server.api.prompts import in_tokenizer_thread, render_chat_prompt, sampling_defaults, sampling_params
from server.api.protocol import ChatCompletionRequest
from server.api.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    InputItemList,
    InputTokens,
    MessageItem,
    ResponseObject,
    ResponsesRequest,
)
from server.api.reasoning import CLOSE, ReasoningParser, grammar_prefix, prompt_start
from server.api.responses_input import chat_request, input_items
from server.api.responses_items import page, with_ids
from server.api.responses_store import ResponseStore, StoredResponse
from server.api.responses_stream import Turn, output_items, response_events
from server.api.routes_chat import _plan, reasoning_parser_for
from server.api.routes_openai import collect, streams
from server.api.sse import HEADERS, EventStreamResponse
from server.api.state import ServerState
from server.api.structured import compile_grammar, request_grammar

log = logging.getLogger("ember.server")
router = APIRouter()
_RENAMED = {"max_tokens": "max_output_tokens"}


def _store(request: Request) -> ResponseStore:
    """The app's store, made at the first use with --responses-store-size records."""
    store: ResponseStore | None = getattr(request.app.state, "responses_store", None)
    if store is None:
        store = request.app.state.responses_store = ResponseStore(request.app.state.settings.responses_store_size)
    return store


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (never stored, deleted, or evicted from "
                    "the store: --responses-store-size)", param="response_id", code="response_not_found")


def _conversation(request: Request, body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(everything before this turn, this turn's input items)."""
    before: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        record = _store(request).get(body.previous_response_id)
        if record is None:
            raise _not_found(body.previous_response_id)
        before = record.conversation()
    return before, input_items(body)


# Responses fields that ask for something Ember does not do: a 400 unless unset (or their neutral value).
_REFUSED = {"background": (False, "Ember runs every response in the foreground"),
            "conversation": (None, "Ember has no conversations: chain turns with previous_response_id"),
            "prompt": (None, "Ember has no stored prompt templates")}


def _log_ignored(body: ResponsesRequest) -> None:
    extra = body.model_extra or {}
    for name, (neutral, why) in _REFUSED.items():
        if extra.get(name, neutral) not in (None, neutral):
            raise APIError(400, f"{name} is not supported: {why}", param=name, code="unsupported_field")
    ignored = sorted(k for k in extra if k not in _REFUSED)
    if ignored:
        log.warning("responses request: ignored unknown fields %s", ", ".join(ignored[:16]))


async def _prompt(state: ServerState, body: ResponsesRequest,
                  items: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, ToolPlan, list[int], str]:
    """(the chat request, its tool plan, prompt ids, prompt text) of a turn over the conversation `items`."""
    chat = chat_request(body, items)
    plan = await _plan(state, chat)
    prompt, text = await in_tokenizer_thread(state, render_chat_prompt, state.core.tokenizer, plan.messages, True,
                                             plan.template_tools, None)
    return chat, plan, prompt, text


def _as_input(items: list[Any]) -> list[dict[str, Any]]:
    """A turn's output items as the next turn's input items (reasoning stays out of later prompts), with their
    output ids, which the next turn's input_items list shows."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"type": "message", "id": item.id, "role": "assistant",
                        "content": [{"type": "output_text", "text": c.text} for c in item.content]})
        elif isinstance(item, FunctionCallItem):
            out.append({"type": "function_call", "id": item.id, "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments})
    return out


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response | ResponseObject:
    state = get_state(request)
    _log_ignored(body)
    check_model(state, body.model)
    before, turn_input = _conversation(request, body)
    chat, plan, prompt, prompt_text = await _prompt(state, body, before + turn_input)
    thinking = reasoning_parser_for(state)
    start = prompt_start(prompt_text) if thinking is not None else None
    grammar = plan.grammar or request_grammar(chat)
    if grammar is not None and start is not None and CLOSE not in grammar.source:
        grammar = replace(grammar, prefix=grammar_prefix(start))
    try:
        params = sampling_params(chat, body.max_output_tokens, logprobs=False, top_logprobs=0,
                                 max_n=state.settings.max_n, grammar=grammar, defaults=sampling_defaults(state))
        if plan.keep_special_tokens:
            params = replace(params, skip_special_tokens=False)
        await compile_grammar(state, grammar)
        check_admission(state, [prompt], params)
    except SamplingParamsError as exc:  # the engine names chat's field; this API calls it max_output_tokens
        raise from_sampling_error(SamplingParamsError(str(exc).replace("max_tokens", "max_output_tokens"),
                                                      _RENAMED.get(exc.param, exc.param))) from None
    turn = Turn(f"resp_{uuid.uuid4().hex}", state.model_name, body, len(prompt), state.core.tokenizer)
    parallel = body.parallel_tool_calls is not False
    outputs = streams(state, turn.response_id, [prompt], params)
    store = _store(request) if body.store else None

    def keep(done: ResponseObject) -> None:
        if store is not None:
            store.put(StoredResponse(done, with_ids(before + turn_input), _as_input(done.output)))

    if body.stream:
        return EventStreamResponse(response_events(turn, outputs, plan.parser, parallel, start, keep),
                                   headers=HEADERS)
    result = (await unless_disconnected(request, collect(outputs, 1, 1)))[0]
    thought, answer = ("", result.text) if start is None else ReasoningParser(start).split(result.text)
    content, calls = message_parts(plan.parser, answer, parallel)
    done = turn.finish(output_items(thought or "", content, calls), result.completion_tokens, result.cached_tokens,
                       result.finish_reason)
    keep(done)
    return done


@router.post("/v1/responses/input_tokens", response_model=None)
async def count_input_tokens(body: ResponsesRequest, request: Request) -> InputTokens:
    """The prompt's length in tokens, as /v1/responses would render it (tools and instructions included)."""
    state = get_state(request)
    check_model(state, body.model)
    before, turn_input = _conversation(request, body)
    _, _, prompt, _ = await _prompt(state, body, before + turn_input)
    return InputTokens(input_tokens=len(prompt))


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, request: Request) -> ResponseObject:
    record = _store(request).get(response_id)
    if record is None:
        raise _not_found(response_id)
    return record.response


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           include: list[str] | None = Query(None)) -> InputItemList:
    """The items the stored response was generated from (server/api/responses_items.py); `include` is accepted
    and has nothing to add: Ember's items carry no optional fields."""
    record = _store(request).get(response_id)
    if record is None:
        raise _not_found(response_id)
    return page(record.history, limit, order, after)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    if not _store(request).delete(response_id):
        raise _not_found(response_id)
    return DeletedResponse(id=response_id)
