"""``streamattn batch`` without Ray: request lines, the resumable output file, the local runner and CLI."""

import json

import pytest

from _model_util import load, need_smollm2, smollm2_path
from streamattn.engine.sampling import SamplingParams
from streamattn.scale.jobs import BadLine, OutputFile, Request, parse_line, read_requests

DEF = dict(max_tokens=5, sampling=SamplingParams(), stop=())


@pytest.mark.parametrize("text,msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt": "x", "temprature": 1}', "unknown key(s) ['temprature']"),
    ('{"id": 1.5, "prompt": "x"}', "id must be a string or an integer"),
    ('{"id": "a"}', "exactly one of 'prompt'"),
    ('{"prompt": "x", "messages": []}', "exactly one of 'prompt'"),
    ('{"prompt": ""}', "prompt must be a non-empty string"),
    ('{"messages": [{"role": "user"}]}', "messages must be a non-empty list"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
    ('{"prompt": "x", "stop": [""]}', "stop must be"),
    ('{"prompt": "x", "top_p": 0}', "top_p must be in (0, 1]"),
])
def test_bad_lines_name_line_and_field(text, msg):
    with pytest.raises(BadLine) as e:
        parse_line(text, 7, **DEF)
    assert e.value.line == 7 and str(e.value).startswith("line 7: ") and msg in str(e.value)


def test_line_overrides_defaults_and_roundtrips():
    r = parse_line('{"id": "q", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, '
                   '"seed": 3, "stop": "."}', 2, **DEF)
    assert (r.id, r.max_tokens, r.stop, r.sampling.temperature, r.sampling.seed) == ("q", 5, (".",), 0.5, 3)
    assert Request.from_json(r.to_json()) == r
    assert parse_line('{"prompt": "x"}', 4, **DEF).id == 4                 # default id: the line number


def test_read_requests_skips_done_and_reports_repeats(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"id": 1, "prompt": "a"}\n\n{"id": "1", "prompt": "b"}\n{"id": 1, "prompt": "c"}\n'
                 '{"id": 2, "prompt": "d"}\n')
    got = read_requests(p, done={json.dumps(2)}, **DEF)
    assert [r.id for r in got.requests] == [1, "1"] and got.already_done == 1
    assert [e.line for e in got.bad] == [4] and "repeats an earlier line's id" in str(got.bad[0])


def test_output_file_resumes_once_per_id(tmp_path, capsys):
    p = tmp_path / "out.jsonl"
    p.write_text('{"id": "a", "text": "x"}\n{"id": "b", "tex')                # a killed run's last line
    with OutputFile(p) as out:
        assert out.done == {'"a"'}
        assert not out.write({"id": "a", "text": "again"})
        assert out.write({"id": "b", "text": "y"}) and not out.write({"id": "b", "text": "z"})
    assert "dropping an unfinished last line" in capsys.readouterr().err
    assert [json.loads(s)["id"] for s in p.read_text().splitlines()] == ["a", "b"]
    p.write_text('{"id": "a"}\nnot a record\n')
    with pytest.raises(ValueError, match="line 2 is not a completion record"):
        OutputFile(p)


PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time, in a land far away, there",
           "The best way to learn to code is"]


@need_smollm2
def test_cli_batch_local_resume_and_bad_lines(tmp_path, capsys, one_thread):
    from streamattn.cli import main
    from streamattn.engine.generate import Generator
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(PROMPTS)]
    inp.write_text("\n".join(lines[:2] + ['{"id": "bad", "prompt": 3}'] + lines[2:]) + "\n")
    argv = ["batch", str(inp), "-o", str(out), "--model", smollm2_path(), "-n", "4", "--batch-size", "3", "-q"]
    assert main(argv) == 2 and out.read_text() == ""                   # --on-error stop: nothing decoded
    assert "line 3: prompt must be a non-empty string" in capsys.readouterr().err
    assert main(argv + ["--on-error", "skip"]) == 1                     # reported, skipped, the rest written
    assert "line 3: prompt must be a non-empty string" in capsys.readouterr().err
    recs = [json.loads(s) for s in out.read_text().splitlines()]
    assert recs[0] == {"id": "bad", "line": 3, "error": "line 3: prompt must be a non-empty string (got 3)"}
    recs = recs[1:]                                                     # the bad line's error record first
    _, tf, tok = load(smollm2_path(), weights="quant")                 # the CLI's default weights
    g = Generator(tf, tok)
    for r, p in zip(recs, PROMPTS):                                     # batched == each prompt alone
        evs = list(g.stream(p, max_tokens=4))
        assert r["text"] == "".join(e.text for e in evs) and r["completion_tokens"] == len(evs)
        assert r["finish_reason"] == evs[-1].finish and r["prompt_tokens"] == len(tok.encode(p))
    assert main(argv + ["--on-error", "skip"]) == 0                     # resumed: nothing left to run (the
    #                                                                     bad line has its error record)
    assert out.read_text().count("\n") == len(PROMPTS) + 1


def test_cli_batch_argument_errors(tmp_path, capsys):
    from streamattn.cli import main
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    assert main(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o"), "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1 (got 0)" in capsys.readouterr().err


@need_smollm2
def test_complete_with_every_request_failing_reports_each(one_thread):
    """A batch whose every line fails before decoding (here: chat messages a template refuses) returns
    one error per line and decodes nothing (the engine is never built with zero slots)."""
    from streamattn.engine.options import ModelOptions
    from streamattn.scale.batch import complete
    from streamattn.engine.generate import Generator
    _, tf, tok = load(smollm2_path(), weights="quant")
    bad = "x" * 10 + "<|im_end|>"
    reqs = [parse_line(json.dumps({"id": i, "messages": [{"role": "user", "content": bad}]}), i + 1,
                       max_tokens=4, sampling=SamplingParams()) for i in range(2)]
    from unittest import mock
    with mock.patch.object(tok, "apply_chat", side_effect=ValueError("the template refuses")):
        res = complete(Generator(tf, tok), reqs, ModelOptions())
    assert [r["line"] for r in res] == [1, 2] and all("the template refuses" in r["error"] for r in res)
