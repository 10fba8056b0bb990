"""The serving engine without HTTP, on a tiny random model: batching, prefill interleaving, the prompt
cache's exactness on full/window/sink caches, cancellation, failure isolation, the queue, stop strings."""

import numpy as np
import pytest

from _model_util import write_tiny_gguf
from streamattn.engine.sampling import SamplingParams
from streamattn.serve.config import ServeConfig
from streamattn.engine.sequence import Job, Sequence, StopFilter

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("prometheus_client")

MODES = {"full": {}, "window": dict(cache="window", window=6), "sinks": dict(cache="sinks", window=6, sinks=2)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from streamattn.gguf.loader import load_gguf
    from streamattn.text.tokenizer import Tokenizer
    from streamattn.models.transformer import Transformer
    m = load_gguf(write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", arch="llama", vocab=64))
    return Transformer(m), Tokenizer.from_metadata(m.metadata)


def make_engine(tiny, **kw):
    from streamattn.engine.core import Engine
    from streamattn.serve.metrics import Metrics
    kw = {"parallel": 3, "prefill_chunk": 8, "prompt_cache_mb": 0, **kw}
    return Engine(*tiny, ServeConfig(**kw).engine_config, Metrics())


def job(prompt, n=6, **kw):
    return Job(prompt=tuple(int(t) for t in prompt), max_tokens=n, ignore_eos=True, **kw)


def submit(eng, j):
    events = []
    s = Sequence(job=j, emit=events.append, tok=eng.tok)
    s.events = events
    eng.submit(s)
    return s


def drain(eng, seqs, limit=500):
    for _ in range(limit):
        if all(s.finished for s in seqs):
            return seqs
        eng.step()
    raise AssertionError("the engine did not finish its requests")


def alone(tiny, j, mode="full", positions="absolute"):
    """Tokens of ``j`` through engine/generate.Generator (another code path, one sequence)."""
    from streamattn.engine.generate import Generator
    c = ServeConfig(prefill_chunk=8, **MODES[mode]).cache_kwargs
    g = Generator(*tiny, cache=c["mode"], window=c["window"], sinks=c["sinks"], prefill_chunk=8,
                  positions=positions)
    return [ev.token_id for ev in g.stream(list(j.prompt), max_tokens=j.max_tokens, ignore_eos=True)]


def prompts(seed, *lens):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 64, n)) for n in lens]


@pytest.mark.parametrize("mode", MODES)
def test_batched_engine_equals_each_request_alone(tiny, mode):
    """5 requests on 3 slots (so two wait, then join between steps) with ragged prompts: each one's greedy
    tokens equal the Generator's for it alone."""
    eng = make_engine(tiny, **MODES[mode])
    jobs = [job(p, n=n) for p, n in zip(prompts(1, 3, 17, 40, 9, 1), (6, 3, 5, 8, 4))]
    seqs = drain(eng, [submit(eng, j) for j in jobs])
    for j, s in zip(jobs, seqs):
        assert s.generated == alone(tiny, j, mode)
        assert s.finish_reason == "length" and s.events[-1].usage["completion_tokens"] == j.max_tokens
    assert eng.running == 0 and all(int(c.lengths.max()) == 0 for c in eng.caches)   # slots freed, rows reset


def test_steps_on_one_thread_or_two_give_the_same_tokens(tiny):
    """With two threads as the ceiling the engine runs its steps on 1 or 2 threads (here alternated over
    the first steps of each kind: the chooser's warm-up), their output heads too, each on its own count,
    and every request's tokens stay those of it alone on one thread."""
    import numba
    from streamattn.runtime.threads import ThreadChooser, threads
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only in this process (NUMBA_NUM_THREADS=1)")
    eng = make_engine(tiny)
    eng.threads, used, heads = ThreadChooser(first=5, keep=5, idle=None), [], []
    choose = eng.threads.choose

    def counted(kind, ceiling, **kw):
        n = choose(kind, ceiling, **kw)
        (heads if isinstance(kind, tuple) else used).append((n, kw.get("gate", True)))
        return n

    eng.threads.choose = counted
    jobs = [job(p, n=n) for p, n in zip(prompts(3, 5, 12, 2), (16, 9, 12))]
    with threads(2):
        seqs = drain(eng, [submit(eng, j) for j in jobs])
    assert used.count((1, True)) >= 5 and used.count((2, True)) >= 5
    # the output head of each such step: its own count (a short head: under the gate like its step)
    assert len(heads) == len(used) and heads.count((1, True)) >= 5 and heads.count((2, True)) >= 5
    for j, s in zip(jobs, seqs):
        assert s.generated == alone(tiny, j)


def test_a_long_output_head_tries_two_threads_whatever_the_gate(tiny):
    """A head that took at least LONG_HEAD_S on one thread is chosen by its times alone: beside a neighbour
    (no CPU idle) its step stays on one thread while the head alternates in its warm-up."""
    import numba
    from streamattn.engine import core
    from streamattn.runtime.threads import ThreadChooser, threads
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only in this process (NUMBA_NUM_THREADS=1)")
    eng = make_engine(tiny)
    eng.threads, seen = ThreadChooser(first=2, keep=5, idle=lambda: 0), []
    choose = eng.threads.choose
    eng.threads.choose = lambda kind, ceiling, **kw: seen.append((kind, choose(kind, ceiling, **kw),
                                                                   kw.get("gate", True))) or seen[-1][1]
    eng.threads.record(("head", 1), 2, 1, 2 * core.LONG_HEAD_S)          # a long head, timed once alone
    j = job(prompts(4, 7)[0], n=6)
    with threads(2):
        s, = drain(eng, [submit(eng, j)])
    assert s.generated == alone(tiny, j)
    steps = [(n, g) for kind, n, g in seen if kind == 1]
    heads = [(n, g) for kind, n, g in seen if kind == ("head", 1)]
    assert steps and all(n == 1 for n, _ in steps)                      # the gate: no CPU idle
    assert heads and all(not g for _, g in heads) and (2, False) in heads


def test_cache_positions_reach_the_model(tiny):
    """--positions cache on a sinks cache: each request equals the Generator with cache positions, and
    (the ring having slid) differs from absolute positions somewhere, so the setting is not ignored."""
    eng = make_engine(tiny, positions="cache", **MODES["sinks"])
    jobs = [job(p, n=8) for p in prompts(7, 30, 12, 41)]
    seqs = drain(eng, [submit(eng, j) for j in jobs])
    assert [s.generated for s in seqs] == [alone(tiny, j, "sinks", positions="cache") for j in jobs]
    assert any(s.generated != alone(tiny, j, "sinks") for j, s in zip(jobs, seqs))


def test_long_prefill_stalls_a_running_stream_by_one_chunk_per_step(tiny):
    eng = make_engine(tiny, parallel=2)
    a = submit(eng, job(prompts(2, 5)[0], n=40))
    eng.step()
    assert len(a.generated) == 1
    b = submit(eng, job(prompts(3, 50)[0], n=2))            # 50 tokens = 7 chunks of <= 8
    for step in range(7):
        before = len(a.generated)
        eng.step()
        assert len(a.generated) == before + 1                # a decodes in every step of b's prefill
        assert b.done == min(50, 8 * (step + 1))
    assert len(b.generated) == 1


@pytest.mark.parametrize("mode", MODES)
def test_prompt_cache_reuses_only_exact_prefixes_and_changes_no_output(tiny, mode):
    """Shared prefix P (30 tokens): the second request reuses it by forking the first one's state and
    rewinding 3 tokens (allowed in every mode: 3 <= max_chunk). A request sharing only 10 tokens would need
    a rewind of 23 > max_chunk in a wrapped ring: the window caches must refuse it (no reuse), the causal
    one reuses 10. A request extending an earlier prompt reuses it whole. Every output equals the output
    without the cache."""
    P, x, y, z = prompts(4, 30, 3, 4, 12)
    first, second, short = job(P + x), job(P + y), job(P[:10] + z)
    eng = make_engine(tiny, prompt_cache_mb=8, **MODES[mode])
    s1 = drain(eng, [submit(eng, first)])[0]
    s2 = drain(eng, [submit(eng, second)])[0]
    s3 = drain(eng, [submit(eng, short)])[0]
    longer = job(list(first.prompt) + s1.generated[:-1] + z)
    s4 = drain(eng, [submit(eng, longer)])[0]
    assert (s1.cached, s2.cached) == (0, 30)
    assert s3.cached == (10 if mode == "full" else 0)
    assert s4.cached == len(first.prompt)
    for j, s in [(first, s1), (second, s2), (short, s3), (longer, s4)]:
        assert s.generated == alone(tiny, j, mode)
        assert s.events[-1].usage["prompt_tokens_details"]["cached_tokens"] == s.cached


def test_prompt_cache_evicts_least_recently_used(tiny):
    from streamattn.engine.prompt_cache import PromptCache
    eng = make_engine(tiny, parallel=1)
    one = sum(c.nbytes for c in eng.model.new_caches(batch=1, **eng.cfg.cache_kwargs))
    pc = PromptCache(2 * one + 10, lambda: eng.model.new_caches(batch=1, **eng.cfg.cache_kwargs))

    def store(tokens):                                         # slot 0 holds exactly ``tokens``, then save it
        for c in eng.caches:
            c.reset(0)
        eng.model.forward(np.array([tokens]), eng.caches)
        return pc.store(tokens, caches=eng.caches, slot=0)

    a, b, c = ([i, 5, 6] for i in (10, 11, 12))
    assert store(a) and store(b)
    assert pc.lookup(a + [7], caches=eng.caches, slot=0) == 3   # a is now the most recent
    assert int(eng.caches[0].lengths[0]) == 3
    assert store(c)                                             # evicts b
    assert len(pc) == 2 and pc.nbytes <= pc.budget
    assert pc.lookup(b + [7], caches=eng.caches, slot=0) == 0
    assert pc.lookup(a + [7], caches=eng.caches, slot=0) == 3
    assert pc.lookup(a, caches=eng.caches, slot=0) == 2          # the last prompt token always runs
    assert int(eng.caches[0].lengths[0]) == 2                    # forked, then rewound by one
    assert not PromptCache(10, pc.new_caches).store(a, caches=eng.caches, slot=0)   # larger than the budget


def test_cancel_frees_the_slot_at_the_next_step(tiny):
    eng = make_engine(tiny, parallel=1, max_queue=4)
    a, b = submit(eng, job(prompts(6, 5)[0], n=50)), submit(eng, job(prompts(7, 5)[0], n=50))
    for _ in range(3):
        eng.step()
    eng.cancel(a)
    eng.cancel(b)                                              # still queued
    n = len(a.events)
    eng.step()
    assert eng.slots == [None] and not eng.queue
    assert len(a.events) == n + 1 and a.events[-1].finish == "cancelled" == b.events[-1].finish   # no more tokens
    assert int(eng.caches[0].lengths[0]) == 0
    hist = {x.name: x.value for x in eng.metrics.cancel_steps.collect()[0].samples}
    assert hist["streamattn_cancel_steps_count"] == 1 and hist["streamattn_cancel_steps_sum"] == 0


def test_a_failing_request_fails_alone(tiny):
    eng = make_engine(tiny)
    good, bad = job(prompts(8, 12)[0]), job(prompts(9, 7)[0], fail=True)
    sg, sb = drain(eng, [submit(eng, good), submit(eng, bad)])
    assert sb.events[-1].kind == "error" and "debug_fail_text" in sb.events[-1].message
    assert sg.generated == alone(tiny, good) and sg.finish_reason == "length"
    assert eng.running == 0


def test_queue_full():
    from streamattn.engine.core import Engine, QueueFull

    class Dummy:
        def new_caches(self, **kw):
            return []
    eng = Engine(Dummy(), None, ServeConfig(parallel=2, max_queue=1, prompt_cache_mb=0).engine_config)
    for _ in range(3):                      # two will take the free slots at the next step, one waits
        eng.submit(object())
    with pytest.raises(QueueFull, match="max_queue=1"):
        eng.submit(object())
    assert len(eng.queue) == 3


def test_stop_strings_never_leak(tiny):
    eng = make_engine(tiny)
    j = job(prompts(10, 6)[0], n=12)
    ref = drain(eng, [submit(eng, j)])[0]
    full = "".join(e.text for e in ref.events if e.kind == "delta")
    stop = full[len(full) // 2: len(full) // 2 + 5]
    s = drain(eng, [submit(eng, Job(**{**j.__dict__, "stop": ("zzz", stop)}))])[0]
    pieces = [e.text for e in s.events if e.kind == "delta"]
    assert "".join(pieces) == full[:full.index(stop)] and s.finish_reason == "stop"


@pytest.mark.parametrize("pieces, stops, out", [
    (["abcE", "N", "D more"], ("END",), ["abc", "", ""]),
    (["abcE", "x"], ("END",), ["abc", "Ex"]),
    (["a<", "/", "s> b"], ("</s>", "b"), ["a", "", ""]),
    (["xx", "yy"], (), ["xx", "yy"]),
])
def test_stop_filter(pieces, stops, out):
    f = StopFilter(stops)
    assert [f.push(p)[0] for p in pieces] == out


@pytest.mark.parametrize("kw, msg", [
    (dict(parallel=0), "parallel must be an integer >= 1"),
    (dict(cache="ring"), "cache must be one of"),
    (dict(window=8), "window must be None with cache='full'"),
    (dict(cache="sinks", sinks=0), "sinks must be an integer >= 1"),
    (dict(max_queue=-1), "max_queue"),
    (dict(prompt_cache_mb=-1), "prompt_cache_mb"),
    (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(port=70000), "port"),
])
def test_serve_config_validates(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ServeConfig(**kw)
    assert ServeConfig(cache="window").cache_kwargs["window"] == 256


def test_config_choices_are_the_model_layers():
    """serve/config keeps its own tuples (it must not import the model layer); they must not drift."""
    from streamattn.gguf.loader import WEIGHT_KINDS
    from streamattn.models.transformer import POSITIONS
    from streamattn.serve import config
    assert config.POSITIONS == POSITIONS and config.WEIGHTS == WEIGHT_KINDS

