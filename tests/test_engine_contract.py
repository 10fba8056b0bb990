"""The engine's contract on the Python API, the CLI and `streamattn batch` (the server's side is in
test_serve_http.py): one stop rule, one set of finish reasons, and a sampled completion that depends only
on its own prompt, parameters and seed."""

import json

import pytest

from _model_util import load, need_smollm2, smollm2_path
from engine_cases import N_TOKENS, PROMPT, greedy, stop_cases
from streamattn.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def generator():
    from streamattn.engine.generate import Generator
    _, tf, tok = load(smollm2_path(), weights="quant")
    return Generator(tf, tok)


@need_smollm2
def test_stop_strings_are_never_streamed_python_api():
    """Streamed pieces never hold a character of a stop string, or of text that might still begin one:
    their concatenation is the text before the first stop string, equal to the non-streamed text."""
    g = generator()
    for name, stop, want, finish in stop_cases(smollm2_path()):
        evs = list(g.stream(PROMPT, chat=True, max_tokens=N_TOKENS, stop=stop))
        assert "".join(e.text for e in evs) == want, name
        assert evs[-1].finish == finish, name
        assert g.generate(PROMPT, chat=True, max_tokens=N_TOKENS, stop=stop) == want, name


@need_smollm2
def test_stop_rule_in_a_ragged_batch():
    """The same cases side by side in one batch: each row's text is its own case's."""
    g = generator()
    cases = stop_cases(smollm2_path())
    prompts = [g.encode_prompt(PROMPT, chat=True) for _ in cases]
    jobs = []
    from streamattn.engine.sequence import Job
    for p, (_, stop, _, _) in zip(prompts, cases):
        jobs.append(Job(prompt=tuple(p), max_tokens=N_TOKENS, stop=stop))
    texts, finish = [""] * len(cases), [None] * len(cases)
    for ev in g.stream_jobs(jobs):
        texts[ev.seq] += ev.text
        finish[ev.seq] = ev.finish
    assert texts == [c[2] for c in cases] and finish == [c[3] for c in cases]


@need_smollm2
def test_stop_rule_and_finish_reason_cli(capsys):
    from streamattn.cli import main
    for name, stop, want, _ in stop_cases(smollm2_path()):
        argv = ["generate", PROMPT, "--chat", "-n", str(N_TOKENS), "-q", "--model", smollm2_path()]
        assert main(argv + [a for s in stop for a in ("--stop", s)]) == 0
        assert capsys.readouterr().out == want + "\n", name


@need_smollm2
def test_stop_rule_finish_reasons_and_neighbours_in_batch(tmp_path):
    """`streamattn batch`: stop cases, an end-of-sequence answer and a seeded sampled line, all in one
    file; each record equals the Python API's text and finish reason for that line alone."""
    from streamattn.cli import main
    cases = stop_cases(smollm2_path())
    lines = [{"id": name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": N_TOKENS,
              "stop": list(stop)} for name, stop, _, _ in cases]
    eos = {"id": "eos", "messages": [{"role": "user", "content": "Reply with one word: is the sky blue?"}],
           "max_tokens": 20}
    sampled = {"id": "sampled", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9,
               "top_p": 0.95, "seed": 11}
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in [lines[0], sampled, *lines[1:], eos]) + "\n")
    assert main(["batch", str(inp), "-o", str(out), "--model", smollm2_path(), "--batch-size", "8", "-q"]) == 0
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for name, _, want, finish in cases:
        assert (recs[name]["text"], recs[name]["finish_reason"]) == (want, finish), name
    g = generator()
    evs = list(g.stream("Reply with one word: is the sky blue?", chat=True, max_tokens=20))
    assert evs[-1].finish == "stop" and len(evs) < 20                        # ended by end-of-sequence
    assert (recs["eos"]["text"], recs["eos"]["finish_reason"]) == ("".join(e.text for e in evs), "stop")
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    assert recs["sampled"]["text"] == g.generate("Once upon a time", max_tokens=12, sampling=p)
    solo_in, solo_out = tmp_path / "solo.jsonl", tmp_path / "solo_out.jsonl"
    solo_in.write_text(json.dumps(sampled) + "\n")
    assert main(["batch", str(solo_in), "-o", str(solo_out), "--model", smollm2_path(), "-q"]) == 0
    assert json.loads(solo_out.read_text())["text"] == recs["sampled"]["text"]


@need_smollm2
def test_seeded_sampling_is_independent_of_batch_neighbours():
    """A seeded sampled completion is the same alone and as one of 4 prompts with other settings; two
    sequences with different seeds in one batch differ (each has its own generator)."""
    g = generator()
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11)
    alone = [e.token_id for e in g.stream("Once upon a time", max_tokens=16, sampling=p)]
    prompts = ["The capital of France is", "Tell me about cats.", "Once upon a time", "1, 2, 3,"]
    params = [SamplingParams(), SamplingParams(temperature=1.2, seed=3), p, SamplingParams(temperature=0.7)]
    evs = list(g.stream_batch(prompts, max_tokens=16, sampling=params))
    assert [e.token_id for e in evs if e.seq == 2] == alone
    assert [e.token_id for e in evs if e.seq == 0] == [e.token_id for e in g.stream(prompts[0], max_tokens=16)]
    twins = list(g.stream_batch(["Once upon a time"] * 2, max_tokens=16,
                                sampling=[p, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=12)]))
    assert [e.token_id for e in twins if e.seq == 0] == alone
    assert [e.token_id for e in twins if e.seq == 1] != alone


@need_smollm2
def test_the_greedy_case_text_is_what_the_cli_prints(capsys):
    """The cases' source text itself: the CLI without stop strings prints exactly it (finish "length")."""
    from streamattn.cli import main
    _, text, _ = greedy(smollm2_path())
    assert main(["generate", PROMPT, "--chat", "-n", str(N_TOKENS), "-q", "--model", smollm2_path()]) == 0
    assert capsys.readouterr().out == text + "\n"
