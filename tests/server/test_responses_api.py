"""POST /v1/responses (OpenAI's Responses API) through the official openai SDK, and an openai-agents loop, on a
real server over the tiny random model: the protocol is what is tested here, not the model's answers (the
grammar forces tool calls and JSON where a test needs them). One slow test chains real SmolLM2 turns.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from server_harness import (API_KEY, MODEL_NAME, TINY_CONTEXT, Server, assert_error, idle, openai_client, run_server,
                            tiny_server, wait_until)
from tiny_models import R1_TEMPLATE

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
         "additionalProperties": False}


def test_plain_response_shape(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Hello there", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 8 and r.temperature == 0 and r.store is True


def test_max_output_tokens_is_incomplete(http: httpx.Client) -> None:
    body = http.post("/v1/responses", json={"input": "Count", "max_output_tokens": 1, "temperature": 0}).json()
    assert body["usage"]["output_tokens"] == 1
    # one token either ends the answer (EOS) or cuts it off
    assert (body["status"], body["incomplete_details"]) in (("completed", None),
                                                            ("incomplete", {"reason": "max_output_tokens"}))


def test_probe_request_answers(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL_NAME, input="", max_output_tokens=1)
    assert r.status in ("completed", "incomplete") and r.usage is not None and r.usage.output_tokens == 1


def test_stream_matches_non_streamed(client: openai.OpenAI) -> None:
    args = dict(model=MODEL_NAME, input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me"}]}],
                max_output_tokens=12, temperature=0)
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(events)))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[:4] == head and types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):-1] == tail
    assert types[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a streamed turn is stored too


def test_stream_sse_event_lines_name_the_type(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True, "max_output_tokens": 3}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas] and len(names) >= 6


def test_disconnect_mid_stream_frees_the_kv(http: httpx.Client, server: Server) -> None:
    # A string of at least 4000 characters: the grammar keeps EOS out, so the request is still running when the
    # client goes away.
    long = {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 4000}}
    body = {"input": "Write", "stream": True, "max_output_tokens": 6000, "text": {"format": long}}
    with http.stream("POST", "/v1/responses", json=body) as resp:
        lines = resp.iter_lines()
        assert any(line == "event: response.output_text.delta" for line in lines)
        wait_until(server, lambda m: m["ember:num_requests_running"] == 1, "the streamed request running")
    wait_until(server, idle, "the aborted request's KV freed")


def _forced_call(client: openai.OpenAI, **extra: object) -> openai.types.responses.Response:
    return client.responses.create(model=MODEL_NAME, input="What is the weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", parallel_tool_calls=False, max_output_tokens=160,
                                   temperature=0, **extra)


def test_required_tool_then_output_chained_and_stateless(client: openai.OpenAI) -> None:
    first = _forced_call(client)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    chained = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert chained.status in ("completed", "incomplete") and chained.previous_response_id == first.id
    # The chained turn's prompt starts with the first turn's prompt: the prefix cache serves it.
    assert chained.usage.input_tokens > first.usage.input_tokens
    assert chained.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens > 0
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments}, result]
    stateless = client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER], store=False,
                                        max_output_tokens=8, temperature=0)
    assert stateless.usage.input_tokens == chained.usage.input_tokens  # the same conversation, the same prompt
    assert stateless.output_text == chained.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stateless.id)  # store: false


def test_streamed_tool_call_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=160, temperature=0, stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments)["city"] in ("Paris", "Oslo")
    final = events[-1].response
    assert [i.type for i in final.output if i.type == "function_call"] == ["function_call"]


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Pick a color", max_output_tokens=48, temperature=0,
                                text={"format": {"type": "json_schema", "name": "color", "schema": COLOR,
                                                 "strict": True}})
    assert r.status == "completed", r.output_text
    assert json.loads(r.output_text)["color"] in ("red", "green", "blue")
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(model=MODEL_NAME, input="JSON please", max_output_tokens=48, temperature=0,
                                  text={"format": {"type": "json_object"}})
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_get_delete_and_input_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Remember me", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    counted = http.post("/v1/responses/input_tokens", json={"input": "Remember me"}).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": r.usage.input_tokens}
    deleted = http.delete(f"/v1/responses/{r.id}").json()
    assert deleted == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert_error(http.delete(f"/v1/responses/{r.id}"), 404)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_missing")


def test_input_items_list_a_chained_turns_conversation(client: openai.OpenAI, http: httpx.Client) -> None:
    first = client.responses.create(model=MODEL_NAME, input="one", max_output_tokens=2, temperature=0)
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "two"}]}]
    second = client.responses.create(model=MODEL_NAME, input=ask, previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0)
    only = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in only.data] == [
        ("message", "user", "input_text", "one")]  # a string input is one user message with one part
    assert only.has_more is False and only.first_id == only.last_id == only.data[0].id
    desc = client.responses.input_items.list(second.id).data  # newest first by default
    assert [(i.role, i.content[0].text) for i in desc] == [("user", "two"), ("assistant", first.output_text),
                                                          ("user", "one")]
    assert desc[1].id == first.output[0].id and desc[1].content[0].type == "output_text"
    assert desc[2].id == only.data[0].id  # an item's id is the same in every listing
    one = client.responses.input_items.list(second.id, order="asc", limit=1)
    assert one.has_more is True and [i.id for i in one.data] == [desc[2].id]
    paged = list(client.responses.input_items.list(second.id, order="asc", limit=1))  # the SDK pages by `after`
    assert [i.id for i in paged] == [i.id for i in desc[::-1]]
    rest = client.responses.input_items.list(second.id, after=desc[0].id, limit=100,
                                             include=["message.output_text.logprobs"])
    assert [i.id for i in rest.data] == [desc[1].id, desc[2].id] and rest.has_more is False
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
    assert assert_error(http.get("/v1/responses/resp_missing/input_items"), 404)["code"] == "response_not_found"
    for query in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_missing"}):
        assert_error(http.get(f"/v1/responses/{second.id}/input_items", params=query), 400)


def test_input_items_of_a_tool_turn(client: openai.OpenAI) -> None:
    first = _forced_call(client)
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER], max_output_tokens=2, temperature=0)
    items = client.responses.input_items.list(chained.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[1].id, items[1].call_id, items[1].name, items[1].arguments) == (call.id, call.call_id, call.name,
                                                                                  call.arguments)
    assert (items[2].call_id, items[2].output, items[2].id.startswith("fco_")) == (call.call_id, "sunny", True)


def test_unrunnable_tool_types_are_dropped(client: openai.OpenAI, server: Server) -> None:
    tools = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
             {"type": "local_shell"}, {"type": "mcp", "server_label": "x", "server_url": "http://x"}]
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, temperature=0)
    r = client.responses.create(model=MODEL_NAME, input="Hi", tools=tools, max_output_tokens=4, temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens == plain.usage.input_tokens
    assert "left out tools Ember cannot run" in server.log()


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
])
def test_bad_input_is_400(http: httpx.Client, client: openai.OpenAI, body: dict, param: str) -> None:
    err = assert_error(http.post("/v1/responses", json=body), 400)
    assert param in (err["param"] or "") or param in err["message"], err
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, **body)


@pytest.fixture(scope="module")
def small_store(make_tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT)
    with tiny_server(model, tmp_path_factory.mktemp("store") / "server.log", "--responses-store-size", "1") as srv:
        yield srv


def test_evicted_id_is_404(small_store: Server) -> None:
    client = openai_client(small_store)
    first = client.responses.create(model=MODEL_NAME, input="one", max_output_tokens=2)
    second = client.responses.create(model=MODEL_NAME, input="two", max_output_tokens=2)
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="three", previous_response_id=first.id)


def test_openai_agents_loop_calls_a_tool_and_finishes(server: Server) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:  # an enum: a random model's call ends in time
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    class Verdict(BaseModel):  # the answer's format bounds the answering turn, so a random model ends it
        weather: Literal["sunny", "rainy"]

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    # tool_choice required forces the first turn's call; the SDK resets it to auto after a tool ran
    # (reset_tool_choice), so the next turn answers, in Verdict's JSON (text.format), and the run finishes.
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], output_type=Verdict,
                         model=agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             max_tokens=160, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=4))
    assert calls and calls[0] and isinstance(result.final_output, Verdict)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--disable-compile", "--max-total-tokens", "16384", "--max-running-requests", "4"]
    with run_server(args, tmp_path_factory.mktemp("smol") / "server.log", timeout=300) as srv:
        yield srv


@pytest.mark.slow
def test_smollm2_chained_turn_reuses_the_previous_turn(smol: Server) -> None:
    client = openai.OpenAI(base_url=smol.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    ask = dict(model=model, instructions="Answer in one sentence.", max_output_tokens=40, temperature=0)
    first = client.responses.create(input="What is the capital of France?", **ask)
    assert first.status == "completed" and "Paris" in first.output_text
    second = client.responses.create(input="And of Italy?", previous_response_id=first.id, **ask)
    assert "Rome" in second.output_text
    # The previous prompt and its answer render again as the same tokens: all but the last are cached (the
    # answer's last token was sampled, never fed through the model, so it has no K/V).
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1
    events = list(client.responses.create(input="What is the capital of France?", stream=True, **ask))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == first.output_text


@pytest.fixture(scope="module")
def r1(make_tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The R1 distills' template: the generation prompt opens the think block, so a random model's whole output is
    reasoning, cut off at max_output_tokens."""
    model = make_tiny_model("llama", max_position_embeddings=TINY_CONTEXT, chat_template=R1_TEMPLATE)
    with tiny_server(model, tmp_path_factory.mktemp("r1") / "server.log") as srv:
        yield srv


def _reasoning_stream(events: list) -> tuple[list[str], str, str]:
    """(the reasoning item's event types in order, its deltas joined, its reasoning_text.done text)."""
    rs_id = next(e.item.id for e in events if e.type == "response.output_item.added" and e.item.type == "reasoning")
    mine = [e for e in events if getattr(e, "item_id", None) == rs_id or getattr(getattr(e, "item", None), "id", None)
            == rs_id]
    deltas = "".join(e.delta for e in mine if e.type == "response.reasoning_text.delta")
    done = [e.text for e in mine if e.type == "response.reasoning_text.done"]
    assert len(done) == 1
    return [e.type for e in mine], deltas, done[0]


REASONING_EVENTS = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of deltas written once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_reasoning_is_its_own_item(r1: Server) -> None:
    client = openai_client(r1)
    ask = dict(model=MODEL_NAME, input="Think", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**ask)
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"] and whole.output_text == "", kinds
    assert whole.output[0].status == "completed" and whole.output[0].summary == []
    thought = whole.output[0].content[0].text
    assert whole.output[0].content[0].type == "reasoning_text"
    assert thought and "<think>" not in thought
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens == 8
    events = list(client.responses.create(stream=True, **ask))
    final = events[-1].response
    assert [i.type for i in final.output] == kinds and final.output[0].content[0].text == thought
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["reasoning", "message"]
    assert added[0].status == "in_progress" and not added[0].content
    types, deltas, done = _reasoning_stream(events)
    assert _collapsed(types) == REASONING_EVENTS
    assert types.count("response.reasoning_text.delta") > 1  # streamed as it is written, not whole at the end
    assert deltas == done == thought
    assert events[[e.type for e in events].index("response.output_item.done")].item.content[0].text == thought


# A string whose pattern spells out </think>, so the grammar is applied as written (test_reasoning.py's way of
# making a random model close its reasoning): reasoning `"step xx yyy`, then the answer `Paris"`.
CLOSING = {"type": "json_schema", "name": "closing",
           "schema": {"type": "string", "pattern": "^step [a-z]{2} [a-z]{3}</think>Paris$"}}


def test_reasoning_streams_ahead_of_the_answer(r1: Server) -> None:
    client = openai_client(r1)
    ask = dict(model=MODEL_NAME, input="Think", max_output_tokens=64, temperature=0, text={"format": CLOSING})
    whole = client.responses.create(**ask)
    assert [i.type for i in whole.output] == ["reasoning", "message"] and whole.status == "completed"
    thought = whole.output[0].content[0].text
    assert re.fullmatch(r'"step [a-z]{2} [a-z]{3}', thought) and whole.output_text == 'Paris"'
    events = list(client.responses.create(stream=True, **ask))
    types = [e.type for e in events]
    assert _collapsed(types) == ["response.created", "response.in_progress", *REASONING_EVENTS,
                                 "response.output_item.added", "response.content_part.added",
                                 "response.output_text.delta", "response.output_text.done",
                                 "response.content_part.done", "response.output_item.done", "response.completed"]
    assert _reasoning_stream(events)[1:] == (thought, thought)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == 'Paris"'
    indexes = {e.item.type: e.output_index for e in events if e.type == "response.output_item.done"}
    assert indexes == {"reasoning": 0, "message": 1}
    assert events[-1].response.output[0].content[0].text == thought
