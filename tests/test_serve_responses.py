"""OpenAI's Responses API (/v1/responses) through the official openai client's ``client.responses``
against the in-process SmolLM2 server (tests/conftest.py ``url``): text whole and streamed equal to the
chat route's, the event sequence, a forced function call and its output sent back, a json_schema format
validated, previous_response_id from the store (and refused when not stored), the store's bounds, and
hostile bodies (400 naming the field, never a 500)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from streamattn.serve.responses import ResponseStore

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}
ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _chat(url, messages, max_tokens, **kw):
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_store_is_lru_and_bounded_by_count_and_characters():
    s = ResponseStore(max_items=3, max_chars=400)
    msg = [{"role": "user", "content": "x" * 50}]
    for i in range(4):
        s.put(f"r{i}", msg)
    assert len(s) == 3 and s.get("r0") is None and s.get("r1") == msg
    s.put("r4", msg)                                 # r1 was read last: r2 leaves
    assert s.get("r2") is None and s.get("r1") == msg and len(s) == 3
    s.put("big", [{"role": "user", "content": "y" * 300}])   # fits alone: the others leave to make room
    assert s.get("big") is not None and len(s) == 1
    s.put("huge", [{"role": "user", "content": "z" * 500}])  # larger than the bound: never stored
    assert s.get("huge") is None and s.get("big") is not None


def test_text_whole_and_streamed_equal_the_chat_route(client, url):
    r = client.responses.create(model=MODEL, instructions="Answer in one sentence.", input=ASK,
                                max_output_tokens=24, temperature=0)
    chat = _chat(url, [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": ASK}], 24)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat["message"]["content"]
    assert r.status == {"stop": "completed", "length": "incomplete"}[chat["finish_reason"]]
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 5 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(model=MODEL, instructions="Answer in one sentence.", input=ASK,
                                          max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage == r.usage
    long = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, temperature=0)
    assert long.status == "incomplete" and long.incomplete_details.reason == "max_output_tokens"


def test_forced_function_call_whole_streamed_and_its_output_sent_back(client, url):
    tools = [WEATHER, TIME]
    ask = "What is the weather in Paris? Use the tools."
    r = client.responses.create(model=MODEL, input=ask, tools=tools, tool_choice={"type": "function", "name": "get_time"},
                                max_output_tokens=80, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_time" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
    with client.responses.stream(model=MODEL, input=ask, tools=tools, tool_choice="required", max_output_tokens=80,
                                 temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed"
    assert final.output[0].type == "function_call"
    fn = {t["name"]: t for t in tools}[final.output[0].name]
    jsonschema.validate(json.loads(final.output[0].arguments), fn["parameters"])
    back = client.responses.create(model=MODEL, tools=tools, tool_choice="none", max_output_tokens=16, temperature=0,
                                   input=[{"role": "user", "content": ask},
                                          {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                           "arguments": call.arguments},
                                          {"type": "function_call_output", "call_id": call.call_id,
                                           "output": "14:05"}])
    chat = _chat(url, [{"role": "user", "content": ask},
                       {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "14:05"}], 16,
                 tools=[{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                        for t in tools], tool_choice="none")
    assert back.output_text == chat["message"]["content"]


def test_json_schema_format_validates_whole_and_streamed(client):
    from structured_cases import SCHEMAS, prompt_for
    for name in ("person", "tags"):
        fmt = {"format": {"type": "json_schema", "name": name, "schema": SCHEMAS[name], "strict": True}}
        r = client.responses.create(model=MODEL, input=prompt_for(name), text=fmt, max_output_tokens=200,
                                    temperature=0)
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), SCHEMAS[name])
        streamed = list(client.responses.create(model=MODEL, input=prompt_for(name), text=fmt, max_output_tokens=200,
                                                temperature=0, stream=True))
        assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == r.output_text


def test_previous_response_id_continues_the_stored_conversation(client, url):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ada. Say hello.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    chat = _chat(url, [{"role": "user", "content": "My name is Ada. Say hello."},
                       {"role": "assistant", "content": first.output_text},
                       {"role": "user", "content": "What is my name?"}], 12)
    assert second.output_text == chat["message"]["content"]    # instructions are not carried over
    streamed = list(client.responses.create(model=MODEL, previous_response_id=second.id, input="And again?",
                                            max_output_tokens=6, temperature=0, stream=True))
    third = streamed[-1].response                           # a streamed response is stored too
    fourth = client.responses.create(model=MODEL, previous_response_id=third.id, input="Thanks.",
                                     max_output_tokens=2, temperature=0)
    assert fourth.usage.input_tokens > third.usage.input_tokens + third.usage.output_tokens
    gone = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    for rid in (gone.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=MODEL, previous_response_id=rid, input="hi", max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"


def test_ignored_fields_are_accepted_and_change_nothing(client):
    plain = client.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0)
    tagged = client.responses.create(model=MODEL, input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": ASK}]}], max_output_tokens=8, temperature=0, store=False, user="u1",
        metadata={"k": "v"}, service_tier="auto", truncation="disabled", parallel_tool_calls=False,
        include=["reasoning.encrypted_content"], reasoning={"effort": None}, prompt_cache_key="k1")
    assert tagged.output_text == plain.output_text


DEEP = {"a": None}
for _ in range(100):
    DEEP = {"a": DEEP}
BASE = {"model": MODEL, "max_output_tokens": 4, "input": ASK}


@pytest.mark.parametrize("change,field", [
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
     "input.0.arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": "[" * 100 + "]" * 100}]}, "input.0.arguments"),
    ({"instructions": ["x"]}, "instructions"),
    ({"max_output_tokens": "4"}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 9}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include.0"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"metadata": DEEP}, "metadata"),
    ({"previous_response_id": 7}, "previous_response_id"),
])
def test_hostile_bodies_are_400_naming_the_field(url, change, field):
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(field), err
    assert err["message"].startswith(field.split(".")[0]), err


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"a": "\\ud800"}', b"[" * 5000 + b"]" * 5000])
def test_malformed_bodies_are_400(url, raw):
    r = httpx.post(url + "/v1/responses", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 10 ** 6) | st.floats(allow_nan=False) |
                     st.text(max_size=8), lambda kids: st.lists(kids, max_size=3) |
                     st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=12)
_item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
    "content": st.text(max_size=8) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": _json}), max_size=2) | _json,
    "call_id": _json, "name": st.sampled_from(["f", "bad name"]) | _json,
    "arguments": st.sampled_from(["{}", '{"a": 1}', "{", "[" * 80]) | _json, "output": _json})
_fields = {"input": st.text(max_size=8) | st.lists(_item, max_size=3) | _json, "instructions": _json,
           "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"])},
                                                   optional={"parameters": _json}), max_size=2) | _json,
           "tool_choice": st.sampled_from(["auto", "none", "required"]) | _json,
           "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
               {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
               optional={"name": _json, "schema": _json})}) | _json,
           "temperature": _json, "top_p": _json, "previous_response_id": _json, "store": _json,
           "reasoning": _json, "include": _json, "metadata": _json, "stream": st.booleans(), "model": _json,
           "bogus": _json}


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=st.lists(st.sampled_from(sorted(_fields)).flatmap(lambda k: st.tuples(st.just(k), _fields[k])),
                        min_size=1, max_size=3))
def test_fuzz_bodies_never_500(url, changes):
    body = {**BASE, **dict(changes)}
    r = httpx.post(url + "/v1/responses", content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "\n" not in err["message"] and len(err["message"]) < 2000
