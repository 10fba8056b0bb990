"""Speculative decoding: prompt-lookup drafts verified in one step give exactly the greedy tokens of plain
decoding (every cache kind, 1 and 2 threads, alone and in ragged batches, SmolLM2 and a six-layer Gemma-3
with Gemma's vocabulary), the sampling rule
keeps the target distribution (chi-square, with a planted bug that must fail), and no rewind a ring would
refuse is ever attempted."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats

from _model_util import gemma_path, load, need_gemma, need_smollm2, smollm2_path, write_tiny_gguf
from streamattn.engine.sampling import SamplingParams, filtered_probs
from streamattn.engine.speculative import DraftPolicy, NgramProposer, SpecParams, StepCosts, verify

CACHES = {"full": dict(), "window": dict(cache="window", window=40),
          "sinks": dict(cache="sinks", window=40, sinks=4),
          "sinks at cache positions": dict(cache="sinks", window=40, sinks=4, positions="cache")}
SPEC = SpecParams(draft_max=8)
N_PROMPTS, TOKENS = 50, 16
CHUNK = 16                                          # the caches' max_chunk: drafts of up to 15 fit
#: Prompt cache room for all N_PROMPTS states of one model and cache kind (the reference asserts it). An
#: entry is a whole batch-1 cache: 11.3 MB for SmolLM2 with a full cache. 256 MB held 22 of SmolLM2's 50,
#: and least-recently-used eviction over prompts taken in order then missed nearly every prompt: each
#: cell prefilled them all again (a cell alone: 595 steps; 276 with a window cache, whose 50 entries fitted).
PROMPT_CACHE_MB = 2048.0


def prompts(n: int) -> list:
    """n prompts, half copy-heavy (the answer repeats the prompt), half ordinary chat questions."""
    code = ["def total(xs):\n    out = 0\n    for x in xs:\n        out += x\n    return out\n",
            "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n",
            '{"name": "Ada", "born": 1815, "field": "mathematics", "city": "London"}',
            "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again."]
    asks = ["Repeat this exactly:\n", "Rename out to result and print the code again:\n",
            "Copy the following text, then say done:\n", "Fix any typo and repeat it:\n"]
    chat = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
            "Write a haiku about rain.", "What is 12 times 7?", "Tell me a fact about cats.",
            "How do plants make food?", "Give me a synonym for happy."]
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(asks[(i // 2) % 4] + code[(i // 8) % 4] + ("" if i < 32 else f"\n(#{i})"))
        else:
            out.append(chat[(i // 2) % 8] + ("" if i < 16 else f" Answer in {i % 5 + 1} sentences."))
    return out


def generator(path, **kw):
    from streamattn.engine.generate import Generator
    _, tf, tok = load(path, weights="quant")
    return Generator(tf, tok, prefill_chunk=CHUNK, **kw)


class FreeRows(StepCosts):
    """Step costs that price every extra row at nothing and ignore the times measured: the policy then
    drafts whatever its acceptance estimate makes worth it, the same way on every run and host (measured
    costs would make the count of drafts depend on this machine's load)."""

    def record(self, rows, seconds):
        pass

    def ratio(self, base, rows):
        return 1.0


def drafting_generator(path, **kw):
    """A generator whose drafts do not depend on timing (:class:`FreeRows` at every thread count)."""
    from streamattn.runtime.threads import thread_count
    g = generator(path, **kw)
    g._step_costs[thread_count()] = FreeRows()
    return g


def engine(g, slots: int, prompt_cache=None):
    """The engine every entry point drives, with ``slots`` rows; a prompt cache (shared between engines
    of one model and cache kind: its entries are batch-1 states) so that later runs skip most prefill."""
    from dataclasses import replace
    from streamattn.engine.core import Engine
    e = Engine(g.model, g.tok, replace(g.config, slots=slots, prompt_cache_mb=PROMPT_CACHE_MB), isolate_failures=False,
               step_costs=FreeRows())                  # drafts that do not depend on this host's load
    if prompt_cache is not None:
        e.prompt_cache = prompt_cache
    return e


def run(e, g, ids, spec, max_tokens=TOKENS):
    """Greedy token ids of every prompt, all queued at once (a ragged batch of the engine's slots, each
    sequence drafting on its own), and the sequences."""
    from streamattn.engine.sequence import Job, Sequence
    seqs = [Sequence(job=Job(prompt=tuple(p), max_tokens=max_tokens, speculative=spec), emit=lambda ev: None,
                     tok=g.tok) for p in ids]
    for s in seqs:
        e.submit(s)
    while e.busy:
        e.step()
    return [list(s.generated) for s in seqs], seqs


# The Gemma-3 classes need Gemma-3's structure (local rings beside the global layers' cache kind, here
# wrapping within a prompt; its layers' weight kinds in verify), not its weights: with the real 270M model
# a class spent 97 s on its reference alone, mostly in the 262k x 640 output matrix. The stand-in's layers
# take the real file's GGUF types, layer for layer (two patterns: v Q8_0 beside ffn_down Q6_K, v Q5_0 beside
# Q4_K), so they run the compiled layers the real model runs, which test_structured.py's Gemma tests need
# anyway: no specialisation of its own to compile. A small embedding scale (0.1) lets the layers steer the
# tied output away from echoing the current token: the greedy text repeats in runs, so drafts are both
# accepted and rejected.
GEMMA3_KINDS = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
                "token_embd": "Q8_0"}
for _i, _kinds in enumerate([{"attn_v": "Q8_0", "ffn_down": "Q6_K"}] * 2 + [{"attn_v": "Q5_0", "ffn_down": "Q4_K"}] * 2
                            + [{"attn_v": "Q8_0", "ffn_down": "Q6_K"}, {"attn_v": "Q5_0", "ffn_down": "Q4_K"}]):
    GEMMA3_KINDS.update({f"blk.{_i}.{name}": kind for name, kind in _kinds.items()})


@pytest.fixture(scope="session")
def tiny_gemma3(request, tmp_path_factory) -> str:
    """A six-layer Gemma-3 of random weights (five sliding layers, window 24, then one global), each layer
    in the GGUF types of Gemma-3-270M's layer of that index, with Gemma-3-270M's tokenizer; written once per
    run (under pytest-xdist the first worker to ask writes it, under a file lock)."""
    import fcntl
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):       # an xdist worker: this run's folder, above the worker's
        root = root.parent
    path = root / "tiny-gemma3.gguf"
    with open(root / "tiny-gemma3.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)              # released when the file closes
        if not path.exists():
            part = root / "tiny-gemma3.gguf.part"
            write_tiny_gguf(part, arch="gemma3", n_layers=6, d_model=64, n_heads=2, n_kv_heads=1, head_dim=128,
                            d_ff=256, window=24, embed_scale=0.1, tokenizer_from=gemma_path(), quant=GEMMA3_KINDS)
            part.rename(path)
    return str(path)


def reference(path: str, cache: str):
    """(generator, prompt ids, plain greedy ids) of N_PROMPTS prompts: plain decoding, ragged batches of
    10, one thread; and the prompt cache that run filled."""
    from streamattn.runtime.threads import threads
    g = generator(path, **CACHES[cache])
    ids = [g.encode_prompt(t, chat=True) for t in prompts(N_PROMPTS)]
    e = engine(g, 10)
    with threads(1):
        plain, _ = run(e, g, ids, None)
    assert len(e.prompt_cache) == N_PROMPTS, f"{len(e.prompt_cache)} of {N_PROMPTS} prompts kept: raise PROMPT_CACHE_MB"
    return g, ids, plain, e.prompt_cache


def check_matrix(ref, n_threads, slots):
    from streamattn.runtime.threads import threads
    g, ids, plain, pc = ref
    with threads(n_threads):
        got, seqs = run(engine(g, slots, pc), g, ids, SPEC)
    bad = [i for i in range(len(ids)) if got[i] != plain[i]]
    assert not bad, f"{len(bad)} of {len(ids)} prompts differ, first {bad[0]}: {got[bad[0]]} != {plain[bad[0]]}"
    drafted, accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    assert accepted >= len(ids) and drafted > accepted        # drafts were kept and rewound: not plain twice


def check_batch_cli(path, cache, ref, n_threads, tmp_path):
    """`streamattn batch --speculative ngram` on the same prompts as chat messages, in batches of 4: every
    record's text is the plain reference's."""
    import json
    from streamattn.cli import main
    g, ids, plain, _ = ref
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": p}], "max_tokens": TOKENS})
                           + "\n" for i, p in enumerate(prompts(N_PROMPTS))))
    flags = [f"--{k}={v}" for k, v in CACHES[cache].items()]
    assert main(["batch", str(inp), "-o", str(out), "--model", path, "-q", "--speculative", "ngram",
                 "--draft-max", str(SPEC.draft_max), "--threads", str(n_threads), "--batch-size", "4",
                 "--prefill-chunk", str(CHUNK), *flags]) == 0
    got = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    assert got == {i: g.tok.decode(plain[i]) for i in range(N_PROMPTS)}


@pytest.mark.heavy
class Matrix:
    """One model and cache kind of the matrix: N_PROMPTS prompts x 1 and 2 threads x alone and in a ragged
    batch of 4, against one plain reference. A class per model and cache kind (eight) lets `pytest -n 2
    --dist loadscope` spread the matrix over both workers, each reference built once, where it is used."""

    model = cache = ""

    @pytest.fixture(scope="class")
    def path(self, request):
        """The class's model file."""
        return request.getfixturevalue("tiny_gemma3") if self.model == "tiny Gemma-3" else smollm2_path()

    @pytest.fixture(scope="class")
    def ref(self, path):
        """:func:`reference` of the class's model and cache kind (dropped after the class)."""
        return reference(path, self.cache)

    @pytest.mark.parametrize("n_threads,slots", [pytest.param(t, s, id=f"{t}-threads-{'alone' if s == 1 else 'batch'}")
                                                 for t in (1, 2) for s in (1, 4)])
    def test_speculation_gives_the_same_tokens(self, ref, n_threads, slots):
        check_matrix(ref, n_threads, slots)


@need_smollm2
class TestSmolLM2Full(Matrix):
    model, cache = "SmolLM2", "full"


@need_smollm2
class TestSmolLM2Window(Matrix):
    model, cache = "SmolLM2", "window"


@need_smollm2
class TestSmolLM2Sinks(Matrix):
    model, cache = "SmolLM2", "sinks"


@need_smollm2
class TestSmolLM2SinksAtCachePositions(Matrix):
    model, cache = "SmolLM2", "sinks at cache positions"

    def test_batch_cli_gives_the_same_tokens(self, path, ref, tmp_path):
        """`streamattn batch --speculative ngram` (2 threads, sinks at cache positions, batches of 4)."""
        check_batch_cli(path, self.cache, ref, 2, tmp_path)


@need_gemma
class TestTinyGemma3Full(Matrix):
    """Gemma-3's structure: its own local rings plus the global layers' cache kind."""
    model, cache = "tiny Gemma-3", "full"


@need_gemma
class TestTinyGemma3Window(Matrix):
    model, cache = "tiny Gemma-3", "window"

    def test_batch_cli_gives_the_same_tokens(self, path, ref, tmp_path):
        """`streamattn batch --speculative ngram` (1 thread, window, batches of 4)."""
        check_batch_cli(path, self.cache, ref, 1, tmp_path)


@need_gemma
class TestTinyGemma3Sinks(Matrix):
    model, cache = "tiny Gemma-3", "sinks"


@need_gemma
class TestTinyGemma3SinksAtCachePositions(Matrix):
    model, cache = "tiny Gemma-3", "sinks at cache positions"


@need_smollm2
def test_speculation_accepts_drafts_on_copy_heavy_prompts(one_thread):
    """The copy-heavy prompts do get drafts accepted (the equality above is not plain decoding twice)."""
    from streamattn.engine.sequence import Job
    g = drafting_generator(smollm2_path())
    ids = g.encode_prompt("Repeat this exactly:\nThe quick brown fox jumps over the lazy dog. The quick brown "
                          "fox jumps again.", chat=True)
    seqs = []
    evs = list(g.stream_jobs([Job(prompt=tuple(ids), max_tokens=40, speculative=SPEC)], seqs=seqs))
    s = seqs[0]
    assert s.accepted >= 10 and len(g.stats.decode_steps_s) < len(evs) - 10
    assert s.usage()["completion_tokens_details"] == {"accepted_prediction_tokens": s.accepted,
                                                      "rejected_prediction_tokens": s.drafted - s.accepted}


@need_smollm2
def test_seeded_sampling_gives_the_same_tokens_with_speculation(one_thread):
    """Sampled (temperature 0.7, top-p 0.9) with a seed: the same tokens with and without drafts, whatever
    the policy drafted (verify draws each position as plain decoding does); drafts were both accepted and
    rejected, and the output differs from greedy."""
    from streamattn.engine.sequence import Job
    g = drafting_generator(smollm2_path())
    ids = g.encode_prompt("Repeat this exactly:\nThe quick brown fox jumps over the lazy dog. The quick brown "
                          "fox jumps again.", chat=True)
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    runs = {}
    for spec in (None, SPEC, SpecParams(draft_max=3)):
        seqs = []
        evs = list(g.stream_jobs([Job(prompt=tuple(ids), max_tokens=40, sampling=sp, speculative=spec)], seqs=seqs))
        runs[spec] = ([e.token_id for e in evs], seqs[0])
    plain = runs[None][0]
    assert runs[SPEC][0] == plain and runs[SpecParams(draft_max=3)][0] == plain
    s = runs[SPEC][1]
    assert s.accepted >= 5 and s.drafted > s.accepted
    greedy = [e.token_id for e in g.stream(ids, max_tokens=40)]
    assert greedy != plain


@need_smollm2
def test_cli_speculative_flag_gives_the_same_text(capsys):
    """`streamattn generate --speculative ngram --draft-max K` prints exactly what plain decoding prints."""
    from streamattn.cli import main
    argv = ["generate", "Repeat this exactly:\nThe quick brown fox jumps over the lazy dog.", "--chat", "-n", "24",
            "-q", "--model", smollm2_path()]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--speculative", "ngram", "--draft-max", "4"]) == 0
    assert capsys.readouterr().out == plain and "quick brown fox" in plain
    assert main(argv + ["--speculative", "ngram", "--draft-max", "0"]) == 2
    assert "--draft-max must be >= 1 (got 0)" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the rule
def _chi2_first_tokens(rule, seed=0, n=20000):
    """Empirical distribution of the first two verified tokens under ``rule`` against the exact one."""
    rng = np.random.default_rng(seed)
    V = 6
    rows = rng.standard_normal((3, V)).astype(np.float32) * 1.5          # [k + 1, V]
    params = SamplingParams(temperature=0.8, seed=None)
    draft = [int(np.argsort(-rows[0])[1]), int(np.argmax(rows[1]))]   # a likely-but-not-top first draft
    p0 = filtered_probs(rows[0], params)
    p1 = filtered_probs(rows[1], params)
    first = np.zeros(V)
    pair = np.zeros((V, V))
    for i in range(n):
        toks = rule(rows, draft, params, np.random.default_rng(1_000_003 * seed + i), lambda j, z: z)
        first[toks[0]] += 1
        if toks[0] == draft[0] and len(toks) > 1:                    # second token given the first drafted
            pair[toks[0], toks[1]] += 1
    want = p0 * n
    c1 = stats.chisquare(first, want)
    cond = pair[draft[0]]
    c2 = stats.chisquare(cond, p1 * cond.sum())
    return c1.pvalue, c2.pvalue


def test_speculative_sampling_keeps_the_distribution():
    """Significance 0.001 per test, fixed seeds: the rule's first and second tokens follow p exactly."""
    p_first, p_second = _chi2_first_tokens(verify)
    assert p_first > 1e-3 and p_second > 1e-3


def test_a_planted_bug_in_the_acceptance_rule_fails_the_chi_square():
    """Resampling from p (instead of p without the rejected token) biases the result: rejected."""
    def buggy(rows, draft, params, rng, prepare):
        from streamattn.engine.sampling import sample
        x = draft[0]
        p = filtered_probs(rows[0], params)
        if rng.random() >= p[x]:
            return [sample(rows[0], params, rng)]                    # the bug: x may come back
        return [x, sample(rows[1], params, rng)]
    p_first, _ = _chi2_first_tokens(buggy)
    assert p_first < 1e-3


def test_greedy_verify_keeps_the_argmax_prefix():
    rows = np.array([[0, 5, 1], [3, 0, 1], [0, 0, 9], [1, 2, 3]], np.float32)
    g = SamplingParams()
    assert verify(rows, [1, 0, 2], g, None, lambda i, z: z) == [1, 0, 2, 2]         # all accepted + one
    assert verify(rows, [1, 2, 2], g, None, lambda i, z: z) == [1, 0]               # second rejected
    assert verify(rows, [0, 0, 2], g, None, lambda i, z: z) == [1]


def test_ngram_proposer_finds_the_longest_match():
    p = NgramProposer(SpecParams(n_min=2, n_max=3))
    assert p.propose([5, 6, 7, 8, 9, 1, 6, 7], 3) == [8, 9, 1]           # "6 7" seen before: what followed
    assert p.propose([1, 2, 3, 4], 3) == []                              # nothing repeats
    assert p.propose([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]              # the most recent occurrence
    assert p.lookup([1, 2, 3, 4], 3) == ([], 0)
    # "3 1 2" occurs twice: the older one matches 5 tokens back (4 5 3 1 2), the recent one 3: older wins
    ctx = [4, 5, 3, 1, 2, 7, 8, 0, 3, 1, 2, 9, 6, 4, 5, 3, 1, 2]
    assert p.lookup(ctx, 2) == ([7, 8], 5)
    assert p.lookup(list(range(40)) + list(range(40)), 4)[1] == NgramProposer.MAX_MATCH      # capped


def test_step_costs_price_rows_from_what_was_timed():
    c = StepCosts()
    assert c.ratio(1, 3) == pytest.approx(1 + 2 * StepCosts.PRIOR_SLOPE)    # nothing timed: the prior
    for t in (10.0, 11.0, 9.0):
        c.record(1, t)
    c.record(5, 18.0)
    assert c.seconds(1) == 10.0 and c.ratio(1, 1) == 1.0 and c.ratio(1, 5) == pytest.approx(1.8)
    assert c.ratio(1, 3) == pytest.approx(1.4)                           # between timed counts: linear
    assert c.ratio(1, 7) == pytest.approx(1.8 + 2 * StepCosts.PRIOR_SLOPE)   # past them: the prior's slope
    for _ in range(StepCosts.KEEP):
        c.record(1, 20.0)                                                # only the recent times count
    assert c.seconds(1) == 20.0 and c.ratio(1, 5) == 1.0                 # never below one step


def test_draft_policy_drafts_what_pays_and_stops_after_misses():
    cheap, dear = (lambda k: 1 + 0.05 * k), (lambda k: 1 + 0.9 * k)
    d = DraftPolicy(8)
    assert d.choose(0, 8, cheap) == 0 and d.choose(20, 0, cheap) == 0     # nothing found
    assert d.choose(20, 8, cheap) == 8                                   # a long match, cheap rows: all
    assert d.choose(20, 8, dear) == 0                                    # rows as dear as steps: none
    assert d.choose(2, 8, lambda k: 1 + 0.3 * k) == 0                    # a short match's prior: not worth it
    drafts = 0                                                           # a miss streak at 8-15 matched tokens
    while (k := d.choose(10, 8, lambda k: 1 + 0.3 * k)) and drafts < 10:
        d.update(10, k, 0)
        drafts += 1
    assert 1 <= drafts <= 3                                              # stopped within three drafts
    for _ in range(4 * DraftPolicy.HALF_LIFE):                           # the misses fade: it tries again
        d.choose(0, 0, cheap)
    assert d.choose(10, 8, lambda k: 1 + 0.3 * k) > 0
    e = DraftPolicy(8)
    for _ in range(20):                                                  # every draft accepted: even short
        e.update(4, 4, 4)                                                # matches become worth drafting
    assert e.choose(2, 8, lambda k: 1 + 0.3 * k) > 0


@settings(max_examples=150, deadline=None)
@given(window=st.integers(1, 24), sinks=st.integers(0, 4), chunk=st.integers(2, 10),
       steps=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.booleans()), min_size=1, max_size=60))
def test_a_draft_rewind_is_always_allowed(window, sinks, chunk, steps):
    """Random prompt chunks (<= max_chunk) and verify steps (1 + k tokens, k <= max_chunk - 1, a of them
    accepted): the rewind of the k - a rejected tokens is always allowed, in every ring, as the engine
    assumes (it calls state.rewind, which would raise)."""
    from streamattn import CacheSpec, KVCache
    from streamattn.kv import state
    c = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=4, window=window, sinks=sinks if sinks else 0,
                          max_chunk=chunk))
    for k, a, prefill in steps:
        if prefill:
            T = k % chunk + 1
            c.append(np.ones((1, 1, T, 4), np.float32), np.ones((1, 1, T, 4), np.float32))
            continue
        k = k % chunk                                                    # k <= chunk - 1
        a = min(a, k)
        c.append(np.ones((1, 1, k + 1, 4), np.float32), np.ones((1, 1, k + 1, 4), np.float32))
        if k - a:
            assert state.can_rewind(c, 0, k - a), (window, sinks, chunk, k, a, int(c.lengths[0]))
            state.rewind(c, 0, k - a)
