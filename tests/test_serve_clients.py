"""Client libraries people put in front of an OpenAI-compatible server (issue 55 item 6), run against the
in-process SmolLM2 server: instructor (a pydantic model in TOOLS and JSON modes), langchain-openai
(invoke, stream, bind_tools, with_structured_output) and the openai-agents SDK (a two-step tool loop).

The replies are forced token by token under the request's own grammar (``tool_templates.force``), so
each test knows what the model says and checks what the library makes of it: the pydantic object's
fields, the tool really called with the forced arguments, the final answer. A forced reply the grammar
forbids would end in the grammar's error, so a library's ``tool_choice`` / ``response_format`` is also
checked to compile and hold.
"""

import json

import pytest

from tool_templates import force, use_template

pytest.importorskip("openai")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.model
MODEL = "smollm2"

try:
    from pydantic import BaseModel, Field
except ImportError:                        # pydantic comes with the serving extras
    BaseModel = object

    def Field(**_):
        return None


class City(BaseModel):
    """A city and what is known of it."""
    name: str = Field(description="the city's name")
    population: int = Field(description="inhabitants")
    capital: bool


PARIS = {"name": "Paris", "population": 2100000, "capital": True}
ASK = "Tell me about Paris."


@pytest.fixture
def server(served):
    """(base URL, state) with the model's own replies and the file's own template restored after."""
    base, st = served
    yield base, st
    force(st, None)
    use_template(st, None)


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
    import openai
    raw = openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=300)
    return lambda mode: instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))


@pytest.mark.parametrize("mode", ["TOOLS", "JSON", "JSON_SCHEMA"])
def test_instructor_extracts_the_forced_object(server, instructor_client, mode):
    """TOOLS mode names the model's function in tool_choice; JSON mode asks json_object, JSON_SCHEMA the
    model's schema: each request compiles, and the forced object comes back as a City."""
    base, st = server
    force(st, tool_call_text("City", PARIS) if mode == "TOOLS" else compact(PARIS))
    city = instructor_client(mode).chat.completions.create(
        model=MODEL, response_model=City, max_retries=0, max_tokens=80,
        messages=[{"role": "user", "content": ASK}])
    assert isinstance(city, City) and city.model_dump() == PARIS


@pytest.mark.parametrize("mode", ["TOOLS", "JSON"])
def test_instructor_streams_partial_objects(server, instructor_client, mode):
    """create_partial (its function is named PartialCity) ends with the whole forced object. In JSON
    mode the content streams token by token, so the objects grow: an earlier one lacks ``capital``; the
    server sends a tool call's arguments in one chunk, so TOOLS mode gets the object whole."""
    base, st = server
    force(st, tool_call_text("PartialCity", PARIS) if mode == "TOOLS" else compact(PARIS))
    parts = list(instructor_client(mode).chat.completions.create_partial(
        model=MODEL, response_model=City, max_retries=0, max_tokens=80,
        messages=[{"role": "user", "content": ASK}]))
    assert parts[-1].model_dump() == PARIS
    if mode == "JSON":
        assert any(p.name == "Paris" and p.capital is None for p in parts)
