"""OpenAI's Responses API on the chat path: the official client's calls, streamed events, tools, errors."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from server.api.response_store import ResponseStore, StoredResponse
from support import live_server, tiny_config

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=1024)
    cfg.server.chat_template = "hermes_tools"  # a template that renders tools and tool results
    with live_server(cfg) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat_text(client, messages, **kw) -> str:
    return client.chat.completions.create(model="tiny", messages=messages, **kw).choices[0].message.content


def test_a_response_is_the_chat_answer_to_the_same_conversation(client):
    resp = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.", temperature=0,
                                   max_output_tokens=12)
    same = _chat_text(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                      temperature=0, max_tokens=12)
    assert resp.output_text == same and resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 12 and resp.usage.total_tokens == resp.usage.input_tokens + 12
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 12 and resp.store is True


def test_streamed_events_rebuild_the_same_response(client):
    kw = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              temperature=0, max_output_tokens=10)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    # the client's own helper reads them too (it returns a final response for response.completed only)
    done = {**kw, "text": {"format": {"type": "json_schema", "name": "c", "schema": {"enum": ["yes", "no"]}}}}
    with client.responses.stream(**done) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == client.responses.create(**done).output_text


def test_function_calls_come_out_as_items_and_go_back_in_as_input(client, server):
    resp = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, temperature=1.0, max_output_tokens=60)
    (call,) = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id.startswith("call_") and resp.status == "completed"
    events = list(client.responses.create(stream=True, model="tiny", input="Weather?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          max_output_tokens=60))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    # the call and its output sent back render as the chat template renders the same conversation
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
    again = client.responses.create(model="tiny", input=history, tools=[WEATHER], max_output_tokens=1)
    chat = [history[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": chat, "tools": tools}).json()["count"]
    assert again.usage.input_tokens == tokens


def test_a_stored_response_is_retrieved_continued_and_deleted(client, server):
    """previous_response_id continues the stored conversation (its prompt is the chat template's for the whole
    conversation, without the earlier instructions), GET returns the stored response, DELETE forgets it."""
    first = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.", temperature=0,
                                    max_output_tokens=6)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id, temperature=0,
                                     max_output_tokens=6)
    conversation = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And then?"}]
    assert second.previous_response_id == first.id
    assert second.output_text == _chat_text(client, conversation, temperature=0, max_tokens=6)
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": conversation}).json()["count"]
    assert second.usage.input_tokens == tokens
    # streamed responses are stored too, and a chain reads the whole conversation
    events = list(client.responses.create(stream=True, model="tiny", input="Go on.", previous_response_id=second.id,
                                          temperature=0, max_output_tokens=4))
    third = client.responses.retrieve(events[-1].response.id)
    assert third.output_text == events[-1].response.output_text and third.previous_response_id == second.id
    longer = conversation + [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Go on."}]
    assert third.usage.input_tokens == httpx.post(f"{server.url}/tokenize", json={"messages": longer}).json()["count"]
    # deleting a response leaves those that continued it whole
    assert httpx.delete(f"{server.url}/v1/responses/{first.id}").json() == {"id": first.id, "object": "response",
                                                                           "deleted": True}
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(model="tiny", input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError, match="not found"):
            call()
    assert client.responses.create(model="tiny", input="More?", previous_response_id=second.id,
                                   max_output_tokens=1).usage.input_tokens > tokens
    # a client's repeated X-Request-Id names neither: each stored response keeps its own id
    twins = [httpx.post(f"{server.url}/v1/responses", json={"input": text, "max_output_tokens": 1},
                        headers={"X-Request-Id": "same-id"}).json() for text in ("a", "b")]
    assert twins[0]["id"] != twins[1]["id"]
    assert [client.responses.retrieve(t["id"]).id for t in twins] == [t["id"] for t in twins]
    unstored = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=1)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_list_what_the_request_gave_newest_first_and_page(client, server):
    given = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "id": "fc_given"},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
             {"role": "user", "content": "And Rome?"}]
    first = client.responses.create(model="tiny", input=given, tools=[WEATHER], max_output_tokens=1)
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message", "function_call_output", "function_call", "message", "message"]
    rome, output, call, paris, system = items.data
    assert rome.content[0].text == "And Rome?" and rome.content[0].type == "input_text" and rome.role == "user"
    assert paris.content[0].text == "Weather in Paris?" and system.role == "system"
    assert call.id == "fc_given" and call.arguments == '{"city": "Paris"}' and output.output == "21 C"
    assert len({i.id for i in items.data}) == 5 and items.first_id == rome.id and items.last_id == system.id
    assert not items.has_more
    # oldest first; pages of two, on from a cursor, and back from one (`before`, over plain HTTP)
    url = f"{server.url}/v1/responses/{first.id}/input_items"
    asc = client.responses.input_items.list(first.id, order="asc", limit=2)
    assert [i.id for i in asc.data] == [system.id, paris.id] and asc.has_more
    on = client.responses.input_items.list(first.id, order="asc", limit=2, after=paris.id)
    assert [i.id for i in on.data] == [call.id, output.id] and on.has_more
    assert [i.id for i in client.responses.input_items.list(first.id, order="asc", after=output.id).data] == [rome.id]
    back = httpx.get(url, params={"order": "asc", "limit": 2, "before": rome.id}).json()
    assert [i["id"] for i in back["data"]] == [call.id, output.id] and back["has_more"] is True
    # a continuation lists its own input only; a string input is one user message
    later = client.responses.create(model="tiny", input="Thanks", previous_response_id=first.id, max_output_tokens=1)
    (thanks,) = client.responses.input_items.list(later.id).data
    assert thanks.role == "user" and thanks.content[0].text == "Thanks"
    for params in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_unknown"}):
        bad = httpx.get(url, params=params)
        assert bad.status_code == 400 and next(iter(params)) in bad.json()["error"]["message"], params
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_the_store_keeps_the_newest_responses():
    store = ResponseStore(2)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is None and store.get("b").response == {"id": "b"} and len(store) == 2
    store.put("d", StoredResponse({"id": "d"}, []))  # b was read last: c goes first
    assert store.get("c") is None and store.get("b") is not None and store.delete("d") and not store.delete("d")
    nothing = ResponseStore(0)
    nothing.put("a", StoredResponse({}, []))
    assert nothing.get("a") is None


def test_a_server_that_stores_nothing_says_so(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=256)
    cfg.server.responses_store_size = 0
    with live_server(cfg) as live:
        first = httpx.post(f"{live.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()
        assert first["store"] is False
        again = httpx.post(f"{live.url}/v1/responses", json={"input": "Hi", "previous_response_id": first["id"]})
        assert again.status_code == 404 and "stores no responses" in again.json()["error"]["message"]


def test_reasoning_effort_reaches_the_template(client, server, monkeypatch):
    serving = server.state.serving
    monkeypatch.setattr(serving, "chat_template", "{{ reasoning_effort }}|{% for m in messages %}{{ m.content }}"
                                                  "{% endfor %}")
    for effort, rendered in (("low", "low|Hi"), (None, "|Hi")):
        resp = client.responses.create(model="tiny", input="Hi", max_output_tokens=1,
                                       **({"reasoning": {"effort": effort, "summary": "auto"}} if effort else {}))
        assert resp.usage.input_tokens == len(serving.tokenizer.encode(rendered, add_special_tokens=False))


def _settled(client, response_id: str, timeout: float = 60.0):
    """A background response polled until it leaves queued / in_progress."""
    deadline = time.monotonic() + timeout
    while (resp := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {resp.status}"
        time.sleep(0.05)
    return resp


def test_a_background_response_is_queued_then_polled_to_the_answer(client):
    """background: answered at once (queued), generated without its client, stored as the answer the same request
    gives in the foreground; continued from as any stored response."""
    kw = dict(model="tiny", input="Hello there", temperature=0, max_output_tokens=8)
    queued = client.responses.create(background=True, **kw)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _settled(client, queued.id)
    foreground = client.responses.create(**kw)
    assert done.status == foreground.status == "incomplete" and done.output_text == foreground.output_text
    assert done.background is True and foreground.background is False and done.usage.output_tokens == 8
    after = client.responses.create(model="tiny", input="And then?", previous_response_id=done.id, max_output_tokens=2)
    assert after.usage.input_tokens > done.usage.input_tokens


def test_a_background_response_is_cancelled_and_its_request_aborted(client, server):
    """cancel stops a background response mid-reply (its engine request aborted: the server is idle right after)
    and keeps it as cancelled; what is not a running background response cannot be cancelled."""
    running = client.responses.create(model="tiny", input="Tell me everything", max_output_tokens=900,
                                      background=True)
    deadline = time.monotonic() + 30
    while client.responses.retrieve(running.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    assert httpx.get(f"{server.url}/load").json()["server_load"] == 0
    running_gauge = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                     if line.startswith("vllm:num_requests_running")]
    assert running_gauge and all(line.endswith(" 0.0") for line in running_gauge)
    for response_id, status in ((running.id, 400), (client.responses.create(model="tiny", input="x",
                                                                           max_output_tokens=1).id, 400),
                                ("resp_nope", 404)):
        reply = httpx.post(f"{server.url}/v1/responses/{response_id}/cancel")
        assert reply.status_code == status, reply.text
        assert "Cannot cancel" in reply.json()["error"]["message"] or status == 404


def test_a_background_response_that_cannot_run_fails_where_it_is_polled(client):
    """A prompt longer than the model takes is found once the reply starts: the response fails, with the error."""
    queued = client.responses.create(model="tiny", input="word " * 1500, max_output_tokens=4, background=True)
    failed = _settled(client, queued.id)
    assert failed.status == "failed" and "tokens" in failed.error.message and failed.output == []


def test_a_background_response_needs_a_store(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=256)
    cfg.server.responses_store_size = 0
    with live_server(cfg) as live:
        reply = httpx.post(f"{live.url}/v1/responses", json={"input": "Hi", "background": True})
        assert reply.status_code == 400 and "stores none" in reply.json()["error"]["message"]


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    resp = client.responses.create(model="tiny", input="A city", max_output_tokens=40, temperature=1.0,
                                   text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert json.loads(resp.output_text)["city"] in ("Paris", "Rome") and resp.status == "completed"


@pytest.mark.parametrize("body, says", [
    ({"input": "x", "previous_response_id": "resp_1"}, "'resp_1' not found"),
    ({"input": []}, "must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input_text"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "beside its reasoning items"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "needs a schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "model": "other"}, "does not exist"),
    ({"input": "x", "model": "other", "background": True}, "does not exist"),
    ({"input": "x", "background": True, "stream": True}, "not both"),
    ({"input": "x", "background": True, "store": False}, "background needs store"),
])
def test_bad_requests_are_openai_errors(server, body, says):
    resp = httpx.post(f"{server.url}/v1/responses", json=body)
    assert resp.status_code in (400, 404) and says in resp.json()["error"]["message"], resp.text
