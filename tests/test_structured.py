"""Structured outputs in the engine: 32 JSON schemas (tests/structured_cases.py) enforced on every token,
on SmolLM2 and Gemma-3, greedy and sampled, streamed and whole, alone and batched beside unconstrained
sequences that stay equal to their solo outputs; logit_bias; schemas we cannot enforce are refused."""

import json

import pytest

from _model_util import gemma_path, load, need_gemma, need_smollm2, smollm2_path
from structured_cases import SCHEMAS, prompt_for, validate
from streamattn.engine.grammar import GrammarError
from streamattn.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("llguidance")


def generator(path):
    from streamattn.engine.generate import Generator
    _, tf, tok = load(path, weights="quant")
    return Generator(tf, tok)


def run_all(g, sampling, budget=256):
    """Every schema as one row of one ragged batch; returns {name: (text, finish)}."""
    names = list(SCHEMAS)
    texts, finish = {n: "" for n in names}, {}
    evs = g.stream_batch([prompt_for(n) for n in names], chat=True, max_tokens=budget, sampling=sampling,
                         grammar=[SCHEMAS[n] for n in names])
    for ev in evs:
        texts[names[ev.seq]] += ev.text
        if ev.finish:
            finish[names[ev.seq]] = ev.finish
    return {n: (texts[n], finish[n]) for n in names}


def check_all(results):
    bad = {}
    for name, (text, finish) in results.items():
        try:
            assert finish == "stop", f"finished {finish!r}"
            validate(SCHEMAS[name], text)
        except Exception as e:                           # noqa: BLE001 - collected, reported together
            bad[name] = f"{type(e).__name__}: {str(e)[:120]} in {text[:80]!r}"
    assert bad == {}


@need_smollm2
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)],
                         ids=["greedy", "sampled"])
def test_smollm2_every_schema_validates(sampling):
    check_all(run_all(generator(smollm2_path()), sampling))


@need_gemma
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)],
                         ids=["greedy", "sampled"])
def test_gemma_every_schema_validates(sampling):
    check_all(run_all(generator(gemma_path()), sampling))


@need_smollm2
def test_constrained_beside_unconstrained_in_a_batch():
    """A batch of 4: two constrained rows (equal to each alone, streamed pieces = whole text) and two
    unconstrained rows whose outputs equal their solo outputs."""
    g = generator(smollm2_path())
    p = SamplingParams(temperature=0.8, seed=9)
    free = ["The capital of France is", "Tell me about cats."]
    cons = ["person", "recipe"]
    prompts = [free[0], prompt_for(cons[0]), free[1], prompt_for(cons[1])]
    grammars = [None, SCHEMAS[cons[0]], None, SCHEMAS[cons[1]]]
    evs = list(g.stream_batch(prompts, chat=True, max_tokens=120, sampling=p, grammar=grammars))
    got = ["".join(e.text for e in evs if e.seq == b) for b in range(4)]
    for b in range(4):
        alone = g.generate(prompts[b], chat=True, max_tokens=120, sampling=p, grammar=grammars[b])
        assert got[b] == alone, b
    validate(SCHEMAS[cons[0]], got[1])
    validate(SCHEMAS[cons[1]], got[3])


@need_smollm2
def test_speculation_under_a_grammar_keeps_tokens_and_validity():
    from streamattn.engine.speculative import SpecParams
    g = generator(smollm2_path())
    for name in ("object_array", "mixed_five", "ref_defs", "enum_array"):
        kw = dict(chat=True, max_tokens=256, grammar=SCHEMAS[name])
        plain = [e.token_id for e in g.stream(prompt_for(name), **kw)]
        evs = list(g.stream(prompt_for(name), speculative=SpecParams(draft_max=6), **kw))
        assert [e.token_id for e in evs] == plain and evs[-1].finish == "stop", name
        validate(SCHEMAS[name], "".join(e.text for e in evs))


@need_smollm2
def test_logit_bias_and_its_errors():
    g = generator(smollm2_path())
    base = [e.token_id for e in g.stream("The capital of France is", max_tokens=3)]
    banned = list(g.stream("The capital of France is", max_tokens=3, logit_bias={base[0]: -100}))
    assert banned[0].token_id != base[0]
    forced = [e.token_id for e in g.stream("The capital of France is", max_tokens=3, logit_bias={"42": 100})]
    assert forced == [42, 42, 42]
    for bias, msg in (({-1: 1}, "outside the vocabulary"), ({"x": 1}, "is not a token id"), ({5: 101}, "[-100, 100]")):
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            g.generate("x", max_tokens=1, logit_bias=bias)


@need_smollm2
def test_unenforceable_schemas_are_refused_by_name():
    g = generator(smollm2_path())
    with pytest.raises(GrammarError, match="not"):
        g.grammars.json_schema({"not": {"type": "string"}})
    with pytest.raises(GrammarError, match="bogus"):
        g.grammars.json_schema({"type": "string", "format": "bogus"})
    with pytest.raises(GrammarError, match="not valid JSON"):
        g.grammars.json_schema("{nope")
    a = g.grammars.json_schema(SCHEMAS["person"])
    assert g.grammars.json_schema(json.loads(json.dumps(SCHEMAS["person"]))) is a      # compiled once


@need_smollm2
def test_cli_json_schema_and_json_flags(tmp_path, capsys):
    from streamattn.cli import main
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["person"]))
    base = ["generate", prompt_for("person"), "--chat", "-n", "80", "-q", "--model", smollm2_path()]
    assert main(base + ["--json-schema", str(schema)]) == 0
    validate(SCHEMAS["person"], capsys.readouterr().out)
    assert main(base + ["--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)
    (tmp_path / "bad.json").write_text('{"not": {"type": "string"}}')
    assert main(base + ["--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "cannot be enforced" in capsys.readouterr().err


@need_smollm2
def test_batch_lines_take_response_format(tmp_path):
    """`streamattn batch`: a line's response_format is enforced; a line whose schema cannot be enforced
    gets an error record naming the keyword, the others still run."""
    from streamattn.cli import main
    lines = [{"id": "p", "messages": [{"role": "user", "content": prompt_for("person")}], "max_tokens": 120,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}}},
             {"id": "free", "prompt": "The capital of France is", "max_tokens": 5},
             {"id": "bad", "prompt": "x", "response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "b", "schema": {"not": {}}}}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rc = main(["batch", str(inp), "-o", str(out), "--model", smollm2_path(), "-q", "--on-error", "skip"])
    recs = {r.get("id"): r for r in map(json.loads, out.read_text().splitlines())}
    assert rc == 1 and "not" in recs["bad"]["error"]
    validate(SCHEMAS["person"], recs["p"]["text"])
    assert recs["free"]["text"] and recs["p"]["finish_reason"] == "stop"
