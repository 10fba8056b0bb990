"""Sampling rules, the generation iterator (stops, batch, seeds) and the CLI."""

import re

import numpy as np
import pytest

from _model_util import load, need_smollm2, smollm2_path
from streamattn.engine.sampling import SamplingParams, apply_repetition_penalty, filtered_probs, sample

pytestmark = pytest.mark.usefixtures("one_thread")


def test_filters():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0, 0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))      # 0.5 + 0.25 reaches 0.7
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0, 0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_allclose(p, [1, 0, 0, 0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))      # keep p >= 0.15
    np.testing.assert_allclose(p, np.array([0.5, 0.25, 0.15, 0]) / 0.9)
    hot = filtered_probs(logits, SamplingParams(temperature=100.0))
    assert hot.max() - hot.min() < 0.01


def test_repetition_penalty_and_greedy():
    x = np.array([2.0, -1.0, 1.5])
    np.testing.assert_allclose(apply_repetition_penalty(x, [0, 1], 2.0), [1.0, -2.0, 1.5])
    rng = np.random.default_rng(0)
    assert sample(x, SamplingParams(), rng) == 0
    assert sample(x, SamplingParams(repetition_penalty=2.0), rng, seen=[0]) == 2


def test_seeded_draws_reproducible():
    logits = np.random.default_rng(0).standard_normal(100)
    p = SamplingParams(temperature=1.0, seed=5)
    a = [sample(logits, p, np.random.default_rng(5)) for _ in range(3)]
    b = [sample(logits, p, np.random.default_rng(5)) for _ in range(3)]
    assert a == b
    draws = {sample(logits, p, np.random.default_rng(s)) for s in range(20)}
    assert len(draws) > 3


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"),
                                    (dict(top_p=0), "top_p"), (dict(min_p=1), "min_p"),
                                    (dict(repetition_penalty=0), "repetition_penalty")])
def test_sampling_params_validate(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def gen(**kw):
    from streamattn.engine.generate import Generator
    _, tf, tok = load(smollm2_path())
    return Generator(tf, tok, prefill_chunk=kw.pop("prefill_chunk", 16), **kw)


@need_smollm2
def test_stream_events_and_finish_reasons():
    g = gen()
    evs = list(g.stream("The capital of France is", max_tokens=6))
    assert [e.step for e in evs] == list(range(6)) and evs[-1].finish == "length"
    assert "".join(e.text for e in evs).startswith(" Paris")
    assert all(e.step_s > 0 for e in evs) and len(g.stats.decode_steps_s) == 5 and g.stats.prefill_s > 0
    import numba
    assert len(g.stats.decode_threads) == 5 and set(g.stats.decode_threads) <= {1, numba.get_num_threads()}
    evs = list(g.stream("What is the capital of France?", chat=True, max_tokens=40))
    assert evs[-1].finish == "stop" and evs[-1].token_id == 2 and "Paris" in "".join(e.text for e in evs)
    text = g.generate("Count: 1, 2, 3,", max_tokens=30, stop=("6",))
    assert text.rstrip().endswith(",") and "6" not in text and "5" in text


@need_smollm2
def test_chunked_prefill_progress_and_chunk_invariance():
    prompt = "A long prompt. " * 12
    seen = []
    a = [e.token_id for e in gen(prefill_chunk=7).stream(prompt, max_tokens=6,
                                                           progress=lambda d, t: seen.append((d, t)))]
    b = [e.token_id for e in gen(prefill_chunk=64).stream(prompt, max_tokens=6)]
    assert a == b and seen[-1][0] == seen[-1][1] and len(seen) > 3


@need_smollm2
def test_batch_equals_single():
    g = gen()
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there", "1, 2, 3,"]
    evs = list(g.stream_batch(prompts, max_tokens=8))
    for b, p in enumerate(prompts):
        assert [e.token_id for e in evs if e.seq == b] == [e.token_id for e in g.stream(p, max_tokens=8)]


@need_smollm2
def test_seeded_generation_reproducible():
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, repetition_penalty=1.1, seed=7)
    a = gen().generate("Tell me about cats.", chat=True, max_tokens=12, sampling=p)
    assert a == gen().generate("Tell me about cats.", chat=True, max_tokens=12, sampling=p)


@need_smollm2
def test_cli_generate_and_errors(capsys, tmp_path):
    from streamattn.cli import main
    assert main(["generate", "The capital of France is", "-n", "3", "-q", "--model", smollm2_path()]) == 0
    assert capsys.readouterr().out.startswith("The capital of France is Paris")
    assert main(["generate", "x", "-q", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "missing.gguf: no such file" in capsys.readouterr().err
    assert main(["inspect", "Hello there, my friend", "-q", "--layers", "0", "--model", smollm2_path()]) == 0
    out = capsys.readouterr().out
    assert "layer head  sink" in out and len(out.splitlines()) == 2 + 9


@need_smollm2
def test_cli_ignore_eos(capsys):
    """The chat answer ends with <|im_end|> after 9 tokens; --ignore-eos decodes all 12 (11 decode steps)."""
    from streamattn.cli import main
    argv = ["generate", "Reply with one word: is the sky blue?", "--chat", "-n", "12", "--stats", "-q",
            "--model", smollm2_path()]
    assert main(argv) == 0
    stopped = capsys.readouterr()
    assert main(argv + ["--ignore-eos"]) == 0
    fixed = capsys.readouterr()
    assert "8 decode steps" in stopped.err and "11 decode steps" in fixed.err
    assert fixed.out.startswith(stopped.out.rstrip("\n")) and len(fixed.out) > len(stopped.out)
    assert " on 1 threads" not in fixed.err and "threads]" not in fixed.err      # one thread: no count
    import numba
    if numba.config.NUMBA_NUM_THREADS >= 2:          # how many steps the thread chooser ran on both
        assert main(argv + ["--ignore-eos", "--threads", "2"]) == 0
        two = capsys.readouterr()
        found = re.search(r"11 decode steps, [\d.]+ tok/s; (\d+) on 2 threads\]", two.err)
        assert found and 0 <= int(found.group(1)) <= 11, two.err


def test_cli_registration_point():
    from streamattn import cli
    with pytest.raises(ValueError, match="already registered"):
        cli.register("generate", "dup", lambda p: None, lambda a: 0)
    names = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert {"pull", "generate", "inspect"} <= names
