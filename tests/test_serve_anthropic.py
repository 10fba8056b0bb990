"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official anthropic client
against the in-process SmolLM2 server (tests/conftest.py ``url``): whole and streamed messages equal the
chat route's text for the same conversation, stop reasons, forced tool use and a tool-result turn,
count_tokens, errors in Anthropic's shape, and hostile bodies (400 naming the field, never a 500)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.model
MODEL = "smollm2"
GREEDY = {"temperature": 0}                     # not in the SDK's typed parameters any more: sent as extra_body
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)


def _chat_text(url, messages, max_tokens):
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _raw_events(url, body) -> list:
    """(event name, data) of each server-sent event of a streamed request."""
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_message_whole_and_streamed_equal_the_chat_route(client, url):
    system = "You answer in one short sentence."
    m = client.messages.create(model=MODEL, max_tokens=24, system=system, messages=ASK, extra_body=GREEDY)
    chat = _chat_text(url, [{"role": "system", "content": system}] + ASK, 24)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat["message"]["content"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["finish_reason"]]
    assert m.stop_sequence is None and m.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=24, system=[{"type": "text", "text": system}],
                                messages=ASK, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    raw = _raw_events(url, {"model": MODEL, "max_tokens": 24, "system": system, "messages": ASK, **GREEDY})
    names = [n for n, _ in raw]
    assert all(n == d["type"] for n, d in raw)
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and "message_stop" in kinds
    assert "".join(d["delta"]["text"] for n, d in raw if n == "content_block_delta") == m.content[0].text
    assert raw[-2][1]["delta"]["stop_reason"] == m.stop_reason


def test_stop_reasons_max_tokens_and_stop_sequence(client):
    long = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 3
    free = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    word = free.split()[2]                                   # a stop string the greedy answer reaches
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=["zzqx", word],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == free[:free.index(word)]
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[word],
                                extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == word
    assert streamed.content[0].text == cut.content[0].text


def _check_use(block, tools):
    schema = {t["name"]: t["input_schema"] for t in tools}[block.name]
    jsonschema.validate(block.input, schema)
    assert block.type == "tool_use" and block.id.startswith("toolu_")


def test_forced_tool_use_whole_streamed_and_a_tool_result_turn(client, url):
    tools = [WEATHER, TIME]
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]
    for choice in ({"type": "tool", "name": "get_time"}, {"type": "any"}):
        m = client.messages.create(model=MODEL, max_tokens=80, tools=tools, tool_choice=choice, messages=ask,
                                   extra_body=GREEDY)
        assert m.stop_reason == "tool_use" and len(m.content) == 1
        _check_use(m.content[0], tools)
        if choice["type"] == "tool":
            assert m.content[0].name == "get_time"
        with client.messages.stream(model=MODEL, max_tokens=80, tools=tools, tool_choice=choice, messages=ask,
                                    extra_body=GREEDY) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
        assert (final.content[0].name, final.content[0].input) == (m.content[0].name, m.content[0].input)
    raw = _raw_events(url, {"model": MODEL, "max_tokens": 80, "tools": tools, "messages": ask, **GREEDY,
                            "tool_choice": {"type": "tool", "name": "get_weather"}})
    deltas = [d["delta"] for n, d in raw if n == "content_block_delta"]
    assert len(deltas) > 1 and {d["type"] for d in deltas} == {"input_json_delta"}      # streamed as generated
    start = next(d for n, d in raw if n == "content_block_start")["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    jsonschema.validate(json.loads("".join(d["partial_json"] for d in deltas)), WEATHER["input_schema"])
    use = m.content[0]
    history = ask + [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                        use.model_dump(exclude_none=True)]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "14:05, sunny"}]}]
    reply = client.messages.create(model=MODEL, max_tokens=20, tools=tools, tool_choice={"type": "none"},
                                   messages=history, extra_body=GREEDY)
    assert reply.content[0].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")
    # the tool turn reaches the prompt: the same history in chat form gives the same text
    chat = _chat_text(url, ask + [{"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "14:05, sunny"}], 20)
    assert reply.content[0].text == chat["message"]["content"]


def test_count_tokens_is_the_prompt_that_runs(client):
    n = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.").input_tokens
    m = client.messages.create(model=MODEL, max_tokens=1, messages=ASK, system="Be brief.", extra_body=GREEDY)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens and n > 5
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.", tools=[WEATHER])
    assert with_tools.input_tokens > n + 20                  # the functions are offered in the prompt


def test_errors_come_in_anthropics_shape(client, url):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=64, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("thinking")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert e.value.body["error"]["message"].startswith("messages")
    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 999999, "messages": ASK})
    assert r.status_code == 400 and set(r.json()) == {"type", "error"} and "max_tokens" in r.json()["error"]["message"]


DEEP = {"a": None}
for _ in range(100):
    DEEP = {"a": DEEP}
BASE = {"model": MODEL, "max_tokens": 4, "messages": ASK}


@pytest.mark.parametrize("change,field", [
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages.0.content.0"),
    ({"messages": ASK + [{"role": "assistant", "content": "The capital is"}]}, "messages.1"),
    ({"system": 7}, "system"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"stop_sequences": ["x" * 1000]}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {"x": {"not": {}}}}}]},
     "tools"),                                 # a nested keyword: named by the grammar compiler
    ({"tools": [WEATHER], "tool_choice": {"type": "bogus"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "adaptive"}}, "thinking"),
    ({"thinking": "on"}, "thinking"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"container": "c1"}, "container"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"metadata": DEEP}, "metadata"),
    ({"model": 7}, "model"),
])
def test_hostile_bodies_are_400_naming_the_field(url, change, field):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
        if path.endswith("count_tokens"):
            if field in ("max_tokens", "stop_sequences", "temperature"):
                continue
            body.pop("max_tokens", None)
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()
        assert set(err) == {"type", "error"} and err["type"] == "error"
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"].startswith(field), \
            (path, err)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"a": "\\ud800"}', b"[" * 5000 + b"]" * 5000])
def test_malformed_bodies_are_400(url, raw):
    r = httpx.post(url + "/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_ignored_fields_are_accepted_and_change_nothing(client):
    plain = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY)
    tagged = client.messages.create(
        model=MODEL, max_tokens=8, metadata={"user_id": "u1"}, service_tier="auto",
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"],
                                                 "cache_control": {"type": "ephemeral"}}]}],
        extra_body={**GREEDY, "thinking": {"type": "disabled"}})
    assert tagged.content[0].text == plain.content[0].text


_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 10 ** 6) | st.floats(allow_nan=False) |
                     st.text(max_size=8), lambda kids: st.lists(kids, max_size=3) |
                     st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=12)
_block = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image",
                                                         "redacted_thinking", "x"])},
                               optional={k: _json for k in ("text", "id", "name", "input", "tool_use_id",
                                                            "content", "thinking", "cache_control")})
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                                  "content": st.text(max_size=8) | st.lists(_block, max_size=3) | _json})
_fields = {"messages": st.lists(_message, min_size=1, max_size=3) | _json, "system": _json,
           "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"]),
                                                     "input_schema": _json}), max_size=2) | _json,
           "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                optional={"name": st.sampled_from(["f", "g"])}) | _json,
           "stop_sequences": _json, "temperature": _json, "top_p": _json, "top_k": _json, "thinking": _json,
           "metadata": _json, "output_config": _json, "stream": st.booleans(), "model": _json,
           "bogus": _json}


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]),
       changes=st.lists(st.sampled_from(sorted(_fields)).flatmap(
           lambda k: st.tuples(st.just(k), _fields[k])), min_size=1, max_size=3))
def test_fuzz_bodies_never_500(url, path, changes):
    body = {**BASE, **dict(changes)}
    if path.endswith("count_tokens"):
        body.pop("max_tokens")
    r = httpx.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], body)
    if r.status_code != 200:
        err = r.json()
        assert set(err) == {"type", "error"} and set(err["error"]) == {"type", "message"}
        assert "\n" not in err["error"]["message"] and len(err["error"]["message"]) < 2000
