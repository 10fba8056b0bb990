"""Client libraries people put in front of an OpenAI-compatible server (issue 55 item 6), run against the
in-process SmolLM2 server: instructor (a pydantic model in TOOLS and JSON modes), langchain-openai
(invoke, stream, bind_tools, with_structured_output), the openai-agents SDK and pydantic-ai (agent
frameworks: a two-step tool loop, and a structured output).

The replies are forced token by token under the request's own grammar (``tool_templates.force``), so
each test knows what the model says and checks what the library makes of it: the pydantic object's
fields, the tool really called with the forced arguments, the final answer. A forced reply the grammar
forbids would end in the grammar's error, so a library's ``tool_choice`` / ``response_format`` is also
checked to compile and hold.
"""

import json

import pytest

from tool_templates import force, use_template

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.model
MODEL = "smollm2"


class City(pydantic.BaseModel):
    """A city and what is known of it."""
    name: str = pydantic.Field(description="the city's name")
    population: int = pydantic.Field(description="inhabitants")
    capital: bool


PARIS = {"name": "Paris", "population": 2100000, "capital": True}
WRONG = {"name": "Paris", "population": "many", "capital": True}       # population not an integer
ASK = "Tell me about Paris."


def compact(value) -> str:
    """JSON as the server's JSON-schema grammars write it (no whitespace between tokens)."""
    return json.dumps(value, separators=(",", ":"))


def tool_call_text(name: str, args: dict) -> str:
    """A call as the model answers under SmolLM2's own template (no native tools: one JSON object)."""
    return compact({"name": name, "arguments": args})


# ------------------------------------------------------------------------------------------- instructor
@pytest.fixture(scope="module")
def instructor_client(served):
    instructor = pytest.importorskip("instructor")
    raw = openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=300)
    return lambda mode: instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))


@pytest.mark.parametrize("mode", ["TOOLS", "JSON", "JSON_SCHEMA"])
def test_instructor_extracts_the_forced_object(server, instructor_client, mode):
    """TOOLS mode names the model's function in tool_choice; JSON mode asks json_object, JSON_SCHEMA the
    model's schema: each request compiles, and the forced object comes back as a City; where the
    request carries the schema, an object against it is stopped by the grammar (instructor's error)."""
    st = server[1]
    force(st, tool_call_text("City", PARIS) if mode == "TOOLS" else compact(PARIS))
    city = instructor_client(mode).chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, max_tokens=80,
        messages=[{"role": "user", "content": ASK}])
    assert isinstance(city, City) and city.model_dump() == PARIS
    if mode != "JSON":                 # JSON mode asks json_object, which any object satisfies
        force(st, tool_call_text("City", WRONG) if mode == "TOOLS" else compact(WRONG))
        from instructor.core.exceptions import InstructorRetryException
        with pytest.raises(InstructorRetryException) as e:
            instructor_client(mode).chat.completions.create(
                model=MODEL, response_model=City, max_retries=0, max_tokens=80,
                messages=[{"role": "user", "content": ASK}])
        assert "the grammar allows no next token" in str(e.value)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON"])
def test_instructor_streams_partial_objects(server, instructor_client, mode):
    """create_partial (its function is named PartialCity) ends with the whole forced object; the content
    (JSON mode) and a tool call's arguments (TOOLS mode) stream token by token, so the objects grow: an
    earlier one lacks ``capital``."""
    st = server[1]
    force(st, tool_call_text("PartialCity", PARIS) if mode == "TOOLS" else compact(PARIS))
    parts = list(instructor_client(mode).chat.completions.create_partial(
        model=MODEL, response_model=City, max_retries=0, max_tokens=80,
        messages=[{"role": "user", "content": ASK}]))
    assert parts[-1].model_dump() == PARIS
    assert any(p.name == "Paris" and p.capital is None for p in parts)


# ------------------------------------------------------------------------------------- langchain-openai
@pytest.fixture(scope="module")
def chat_model(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=served[0] + "/v1", api_key="none", model=MODEL, max_retries=0,
                                       timeout=300, max_tokens=80)


def test_langchain_invoke_and_stream(server, chat_model):
    st = server[1]
    force(st, "Paris is the capital of France.")
    assert chat_model.invoke("Tell me about Paris.").content == "Paris is the capital of France."
    chunks = [c.content for c in chat_model.stream("Tell me about Paris.")]
    assert len([c for c in chunks if c]) > 1 and "".join(chunks) == "Paris is the capital of France."


def get_weather(city: str, unit: str) -> str:
    """The weather in a city, in celsius or fahrenheit."""
    return f"sunny in {city}, 21 degrees {unit}"


@pytest.mark.parametrize("tool_choice", [None, "get_weather"])
def test_langchain_bind_tools_reads_the_call(server, chat_model, tool_choice):
    """A bound function called by the (forced) model comes back in AIMessage.tool_calls, whole and
    streamed; with ``tool_choice`` naming it the request's grammar holds the call."""
    st = server[1]
    args = {"city": "Paris", "unit": "celsius"}
    force(st, tool_call_text("get_weather", args))
    model = chat_model.bind_tools([get_weather], **({"tool_choice": tool_choice} if tool_choice else {}))
    msg = model.invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", args)]
    assert msg.tool_calls[0]["id"].startswith("call_") and not msg.content
    total = None
    for chunk in model.stream("Weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("get_weather", args)]


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output(server, chat_model, method):
    """with_structured_output(City) in each of its methods: response_format json_schema (strict), a
    named function, or json_object; the forced object comes back as a City, and a reply the request's
    format forbids is the grammar's 400."""
    st = server[1]
    force(st, tool_call_text("City", PARIS) if method == "function_calling" else compact(PARIS))
    city = chat_model.with_structured_output(City, method=method).invoke(ASK + " Answer in JSON.")
    assert isinstance(city, City) and city.model_dump() == PARIS
    bad = {"function_calling": tool_call_text("City", WRONG), "json_schema": compact(WRONG),
           "json_mode": "Paris."}[method]                        # json_object only holds it to JSON
    force(st, bad)
    with pytest.raises(openai.BadRequestError) as e:
        chat_model.with_structured_output(City, method=method).invoke(ASK)
    assert e.value.code == "grammar_error"


# ---------------------------------------------------------------------------------------- openai-agents
ANSWER = "It is sunny in Paris, 21 degrees."


def weather_loop(base, st, template):
    """What both agent frameworks' two-step loops share: (the plain weather tool, which records its
    arguments in ``calls`` and forces the answer when it runs; ``calls``; an AsyncOpenAI client on the
    server that records each request body in ``bodies``; ``bodies``). The first reply is forced here to
    call the tool, in the template's syntax."""
    import httpx
    calls, bodies = [], []

    async def keep(request):
        bodies.append(json.loads(request.content))

    def weather(city: str, unit: str) -> str:
        """The weather in a city, in celsius or fahrenheit."""
        calls.append({"city": city, "unit": unit})
        force(st, ANSWER)
        return f"sunny in {city}, 21 degrees {unit}"

    args = {"city": "Paris", "unit": "celsius"}
    force(st, tool_call_text("weather", args) if template is None else
          f'<tool_call>\n{compact({"name": "weather", "arguments": args})}\n</tool_call>')
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300,
                                http_client=httpx.AsyncClient(event_hooks={"request": [keep]}))
    return weather, calls, client, bodies


def agent_run(base, st, template, streamed):
    """(final output, the arguments the tool was called with, the run's item types, the request bodies)
    of an Agent with one function tool. The forced first reply calls the tool; the tool, when it runs,
    forces the answer."""
    agents = pytest.importorskip("agents")
    weather, calls, client, bodies = weather_loop(base, st, template)
    agent = agents.Agent(name="forecaster", instructions="Answer weather questions with the tool.",
                         tools=[agents.function_tool(weather)], model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=80))
    if streamed:
        import asyncio

        async def run():
            result = agents.Runner.run_streamed(agent, "Weather in Paris?")
            async for _ in result.stream_events():
                pass
            return result
        result = asyncio.run(run())
    else:
        result = agents.Runner.run_sync(agent, "Weather in Paris?")
    return result.final_output, calls, [item.type for item in result.new_items], bodies


@pytest.mark.parametrize("template, streamed", [(None, False), (None, True), ("qwen", False)])
def test_agents_sdk_two_step_tool_loop(server, template, streamed):
    """Runner runs the Agent's loop: the model's first reply calls the function tool, which the SDK
    really calls with the forced arguments; its result goes back in the history, and the second reply
    is the final answer. Under SmolLM2's own template and a Hermes one (native calls), run and streamed."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    base, st = server
    use_template(st, template)
    final, calls, items, bodies = agent_run(base, st, template, streamed)
    assert calls == [{"city": "Paris", "unit": "celsius"}] and len(bodies) == 2
    history = bodies[1]["messages"]
    assert [m["role"] for m in history[-2:]] == ["assistant", "tool"]
    assert history[-2]["tool_calls"][0]["id"] == history[-1]["tool_call_id"]
    assert history[-1]["content"] == "sunny in Paris, 21 degrees celsius"
    assert items == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert final == ANSWER


def test_agents_sdk_structured_final_output(server):
    """An Agent with ``output_type=City`` asks response_format json_schema (strict): its final output
    is the forced City, and an object against the schema is the grammar's 400."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    base, st = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    agent = agents.Agent(name="atlas", instructions="Describe the city.", output_type=City,
                         model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(max_tokens=80))
    force(st, compact(PARIS))
    assert agents.Runner.run_sync(agent, ASK).final_output == City(**PARIS)
    force(st, compact(WRONG))
    with pytest.raises(openai.BadRequestError) as e:
        agents.Runner.run_sync(agent, ASK)
    assert e.value.code == "grammar_error"


# ------------------------------------------------------------------------------------------ pydantic-ai
def pydantic_ai_run(base, st, template, streamed):
    """(final output, the arguments the tool was called with, the request bodies) of a pydantic-ai Agent
    with one plain tool on OpenAIChatModel. The forced first reply calls the tool; the tool, when it runs,
    forces the answer."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    import asyncio
    weather, calls, client, bodies = weather_loop(base, st, template)
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    agent = pydantic_ai.Agent(model, instructions="Answer weather questions with the tool.",
                              model_settings={"max_tokens": 80})
    agent.tool_plain(weather)
    if streamed:
        async def run():
            async with agent.run_stream("Weather in Paris?") as result:
                return await result.get_output()
        return asyncio.run(run()), calls, bodies
    return agent.run_sync("Weather in Paris?").output, calls, bodies


@pytest.mark.parametrize("template, streamed", [(None, False), (None, True), ("qwen", False), ("qwen", True)])
def test_pydantic_ai_two_step_tool_loop(server, template, streamed):
    """pydantic-ai's Agent loop: the model's first reply calls the plain tool, which pydantic-ai really
    calls with the forced arguments; its result goes back in the history, and the second reply is the
    output. Under SmolLM2's own template and a Hermes one (native calls), run and streamed."""
    base, st = server
    use_template(st, template)
    final, calls, bodies = pydantic_ai_run(base, st, template, streamed)
    assert calls == [{"city": "Paris", "unit": "celsius"}] and len(bodies) == 2
    assert all(b.get("stream", False) == streamed for b in bodies)
    history = bodies[1]["messages"]
    assert [m["role"] for m in history[-2:]] == ["assistant", "tool"]
    assert history[-2]["tool_calls"][0]["id"] == history[-1]["tool_call_id"]
    assert history[-1]["content"] == "sunny in Paris, 21 degrees celsius"
    assert final == ANSWER


def test_pydantic_ai_structured_output(server):
    """An Agent with ``output_type=City`` offers pydantic-ai's output tool (``final_result``): the forced
    call of it is the run's output, and an object against the schema is the grammar's 400."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    base, st = server
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    agent = pydantic_ai.Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)),
                              output_type=City, model_settings={"max_tokens": 80})
    force(st, tool_call_text("final_result", PARIS))
    assert agent.run_sync(ASK).output == City(**PARIS)
    force(st, tool_call_text("final_result", WRONG))
    with pytest.raises(ModelHTTPError) as e:
        agent.run_sync(ASK)
    assert e.value.status_code == 400 and "grammar" in str(e.value.body)
