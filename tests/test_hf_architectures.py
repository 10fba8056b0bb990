"""Each architecture against HF transformers: a tiny seeded model, written to GGUF by our own writer
(tests/_hf_gguf.py), loaded by ``load_gguf``, and our logits compared with transformers' forward at every
position of a 48-token sequence (float32 path: max|ours - theirs| / max|theirs| <= 1e-3; packed path at
Q8_0, the compiled layers: cosine >= 0.999 at every position), the same for the final hidden states
(``Transformer.hidden_states``, what embeddings pool), greedy continuations equal on the float32 path.
Needs torch and transformers (the ``hfref`` extra, installed by scripts/setup.sh)."""

import dataclasses

import numpy as np
import pytest

from _hf_gguf import hf_model, write_gguf
from oracle import rel_err
from streamattn.gguf.loader import load_gguf
from streamattn.gguf.metadata import ModelFileError
from streamattn.models.transformer import Transformer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

N, PROMPT, NEW, CHUNK = 48, 16, 16, 16
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}   # every kind of dimension at 48
#: Phi-3 su/longrope (Phi-3-*-128k, Phi-3.5): per-frequency divisors, the long ones for a context above
#: original_max_position_embeddings (8: HF uses them for every call here, prompt and greedy steps alike),
#: and an attention factor sqrt(1 + ln(32 / 8) / ln 8) = 1.29 on cos and sin (Phi-3-mini-128k: 1.19)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "long_factor": np.geomspace(1.0, 24.0, 16).round(4).tolist(),
            "short_factor": np.linspace(1.0, 1.5, 16).round(4).tolist()}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "llama3": dict(arch="llama", rope=LLAMA3),                       # untied output, permuted q/k rows
    # llama with every layer sliding, from llama.attention.sliding_window (which llama.cpp's converter
    # does not write: tests/test_arch_fixtures.py has a Mistral without a window)
    "mistral": dict(arch="mistral", sliding_window=16),
    "qwen2": dict(arch="qwen2", tied=True, rope={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": dict(arch="qwen3", head_dim=64, tied=True, rope={"rope_type": "default", "rope_theta": 1e6}),
    # fused qkv and gate/up; every layer slides (16 keys: the window binds within 48 positions)
    # 6 layers: 5 sliding (window 8), layer 5 global with linear RoPE scaling (factor 8, as Gemma-3 4B+)
    "gemma3": dict(arch="gemma3", layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8, tied=True,
                   rope={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}),
    "phi3": dict(arch="phi3", sliding_window=16, pad_token_id=0, rope={"rope_type": "default", "rope_theta": 10000.0}),
    "phi3_longrope": dict(arch="phi3", sliding_window=16, pad_token_id=0, original_max_position_embeddings=8,
                          max_position_embeddings=32, rope=LONGROPE),
    # YaRN (Qwen2.5/Qwen3 past 32k) from 64 to 256 positions: at head size 32 the ramp runs over dimensions
    # 0..5 of 16, the rest divided by 4 (turning enough over 48 positions for the test to see it)
    "qwen2_yarn": dict(arch="qwen2", tied=True, rope=YARN),
    # 4 layers alternating sliding (window 8) / global; caps small enough to bind on these scores (~N(0, 1))
    # and logits (~N(0, 11²)); query_pre_attn_scalar = head_dim 64, not d_model / heads = 32 (llama.cpp's rule)
    "gemma2": dict(arch="gemma2", layers=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=8, tied=True,
                   attn_logit_softcapping=1.5, final_logit_softcapping=12.0),
}

#: Metadata llama.cpp's converter adds for a case (its rope scaling keys).
KV = {"gemma3": {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, HF model, f32 GGUF path, Q8_0 GGUF path, token ids [N])."""
    name = request.param
    model = hf_model(**CASES[name], seed=len(name))
    d = tmp_path_factory.mktemp(name)
    ids = np.random.default_rng(7).integers(3, model.config.vocab_size, N).tolist()
    kv = KV.get(name, {})
    return (name, model, write_gguf(model, d / "f32.gguf", extra_kv=kv),
            write_gguf(model, d / "q8.gguf", quant="Q8_0", extra_kv=kv), ids)


def theirs(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()              # [T, vocab]


def ours(tf, ids) -> np.ndarray:
    caches = tf.new_caches(batch=1, max_chunk=CHUNK)
    return np.concatenate([tf.forward(np.array([ids[s:s + CHUNK]]), caches)[0]
                           for s in range(0, len(ids), CHUNK)])                 # [T, vocab]


def test_float32_logits_match_transformers(case):
    name, model, path, _, ids = case
    m = load_gguf(path, weights="f32")
    assert m.config.arch == {"mistral": "llama"}.get(CASES[name]["arch"], CASES[name]["arch"])
    ref = theirs(model, ids)
    err = rel_err(ours(Transformer(m), ids), ref)
    print(f"\n{name}: f32 max rel err {err:.2e} over {N} positions")
    assert err <= 1e-3
    assert np.abs(ref).max() > 2 and ref.std(axis=-1).min() > 0.3      # logits spread: the test can fail


def test_packed_q8_0_logits_match_transformers(case):
    """The packed path: Q8_0 matrices through the compiled layers (checked to be the ones that ran)."""
    name, model, _, path, ids = case
    tf = Transformer(load_gguf(path))
    got, ref = ours(tf, ids), theirs(model, ids)
    assert tf._compiled is not None and all(w is not None for w in tf._compiled.weights)
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))   # [T]
    print(f"\n{name}: Q8_0 packed min cosine {cos.min():.6f}, max rel err {rel_err(got, ref):.2e}")
    assert cos.min() >= 0.999


def test_hidden_states_match_transformers(case):
    """``Transformer.hidden_states`` (what /v1/embeddings pools) against the base model's
    ``last_hidden_state`` (after the final norm): float32 max rel err <= 1e-5 (measured <= 6e-7,
    2026-12-07); the packed Q8_0 path cosine >= 0.999 at every position (measured >= 0.9996). Chunks of 5
    (not a divisor of the 48 positions) cut the sliding windows anywhere."""
    name, model, f32, q8, ids = case
    with torch.no_grad():
        ref = model.model(torch.tensor([ids])).last_hidden_state[0].float().numpy()      # [T, d]
    got = Transformer(load_gguf(f32, weights="f32")).hidden_states(np.array(ids), chunk=5)
    err = rel_err(got, ref)
    packed = Transformer(load_gguf(q8)).hidden_states(np.array(ids), chunk=5)
    cos = (packed * ref).sum(-1) / (np.linalg.norm(packed, axis=-1) * np.linalg.norm(ref, axis=-1))   # [T]
    print(f"\n{name}: hidden states f32 max rel err {err:.2e}; Q8_0 min cosine {cos.min():.6f}")
    assert got.shape == ref.shape == (N, model.config.hidden_size) and got.dtype == np.float32
    assert err <= 1e-5 and cos.min() >= 0.999
    assert ref.std(axis=0).min() > 0.01                      # the positions differ: the test can fail


def test_float32_greedy_matches_transformers(case):
    name, model, path, _, ids = case
    tf = Transformer(load_gguf(path, weights="f32"))
    caches = tf.new_caches(batch=1, max_chunk=PROMPT)
    logits = tf.forward(np.array([ids[:PROMPT]]), caches, last_only=True)[0]
    mine = []
    for _ in range(NEW):
        mine.append(int(np.argmax(logits)))
        logits = tf.forward(np.array([[mine[-1]]]), caches, last_only=True)[0]
    seq = list(ids[:PROMPT])
    for _ in range(NEW):
        seq.append(int(np.argmax(theirs(model, seq)[-1])))
    assert mine == seq[PROMPT:]


def test_llama3_rope_factors_are_what_makes_it_match(tmp_path):
    """Without rope_freqs.weight (the file as a loader that ignored it would read it) the logits are far
    off: the comparison above does see RoPE scaling."""
    model = hf_model(**CASES["llama3"], seed=6)
    ids = np.random.default_rng(7).integers(3, model.config.vocab_size, N).tolist()
    path = write_gguf(model, tmp_path / "no_factors.gguf", drop_tensors=("rope_freqs.weight",))
    assert rel_err(ours(Transformer(load_gguf(path, weights="f32")), ids), theirs(model, ids)) > 0.05


@pytest.mark.parametrize("key, value, match", [
    ("llama.attn_logit_softcapping", 30.0, "metadata key 'llama.attn_logit_softcapping' = '30.0'"),
    ("llama.final_logit_softcapping", 30.0, "metadata key 'llama.final_logit_softcapping'"),
    ("llama.rope.scaling.type", "longrope", r"RoPE scaling 'longrope' \(llama.rope.scaling.type\) is not supported "
                                            "for architecture 'llama'"),
    ("llama.rope.scaling.yarn_beta_fast", 16.0, "metadata key 'llama.rope.scaling.yarn_beta_fast' = '16.0'"),
    ("llama.rope.scaling.attn_factor", 2.0, "llama.rope.scaling.attn_factor' = 2.0 is not supported"),
    ("llama.expert_count", 8, "metadata key 'llama.expert_count' = '8'"),
    ("llama.rope.dimension_count", 16, "'llama.rope.dimension_count' = 16 differs from the head size 32"),
])
def test_a_forward_changing_key_is_refused_by_name(tmp_path, key, value, match):
    model = hf_model(**CASES["llama3"], seed=6)
    path = write_gguf(model, tmp_path / "m.gguf", extra_kv={key: value})
    for weights in ("f32", "quant"):
        with pytest.raises(ModelFileError, match=match):
            load_gguf(path, weights=weights)


def test_an_unexpected_tensor_is_refused_by_name(tmp_path):
    """A qwen2 file read as llama (its q/k/v biases unused) is refused naming a bias."""
    model = hf_model(arch="qwen2", rope={"rope_type": "default", "rope_theta": 1e6})
    raw = open(write_gguf(model, tmp_path / "q.gguf"), "rb").read()
    path2 = tmp_path / "as_llama.gguf"                 # the architecture and its keys renamed, same length
    path2.write_bytes(raw.replace(b"qwen2", b"llama"))
    assert load_gguf(str(tmp_path / "q.gguf"), weights="f32").config.arch == "qwen2"
    with pytest.raises(ModelFileError, match=r"tensor 'blk\.0\.attn_k\.bias' .* is not used by architecture 'llama'"):
        load_gguf(str(path2), weights="f32")


@pytest.mark.parametrize("case", ["phi3_longrope"], indirect=True)
def test_phi3_long_factors_and_attention_factor_are_what_makes_it_match(case):
    """Without the attention factor, or with the short factors, the logits are far off: the comparison
    above sees both (the long factors are picked from the file's context, 32 > 8)."""
    name, model, f32, q8, ids = case
    ref = theirs(model, ids)
    for path in (f32, q8):
        m = load_gguf(path, weights="f32" if path == f32 else "quant")
        assert Transformer(m).rope_factors == "long" and m.config.rope_attn_factor > 1.25
        unscaled = dataclasses.replace(m, config=dataclasses.replace(m.config, rope_attn_factor=1.0))
        assert rel_err(ours(Transformer(unscaled), ids), ref) > 0.05, path
        assert rel_err(ours(Transformer(m, context=8), ids), ref) > 0.05, path


@pytest.mark.parametrize("case", ["qwen2_yarn"], indirect=True)
def test_yarn_is_what_makes_it_match(case):
    """Without YaRN's divisors or without its attention factor 1 + 0.1 ln 4 the logits are far off."""
    name, model, f32, q8, ids = case
    ref = theirs(model, ids)
    for path in (f32, q8):
        m = load_gguf(path, weights="f32" if path == f32 else "quant")
        assert m.config.rope_yarn == 4.0 and m.config.rope_attn_factor == pytest.approx(1 + 0.1 * np.log(4.0))
        for change in (dict(rope_yarn=None), dict(rope_attn_factor=1.0)):
            other = dataclasses.replace(m, config=dataclasses.replace(m.config, **change))
            assert rel_err(ours(Transformer(other), ids), ref) > 0.05, (path, change)


@pytest.mark.parametrize("kv, match", [
    ({"qwen2.rope.scaling.yarn_beta_fast": 16.0}, r"'qwen2.rope.scaling.yarn_beta_fast' = 16.0 is not supported "
                                                  r"\(only 32"),
    ({"qwen2.rope.scaling.yarn_attn_factor": 1.0}, r"'qwen2.rope.scaling.yarn_attn_factor' = 1.0 is not supported"),
    ({"qwen2.rope.scaling.yarn_log_multiplier": 0.1}, r"'qwen2.rope.scaling.yarn_log_multiplier' = 0.1"),
])
def test_yarn_keys_llama_cpp_would_not_run_are_refused(tmp_path, kv, match):
    """llama.cpp's loader reads no YaRN beta/ext/attn key (it runs 32, 1, 1, 1 + 0.1 ln factor) while HF
    runs a config's: a file at another value is refused by name, as is a YaRN file of gemma3."""
    model = hf_model(**CASES["qwen2_yarn"], seed=2)
    with pytest.raises(ModelFileError, match=match):
        load_gguf(write_gguf(model, tmp_path / "y.gguf", extra_kv=kv), weights="f32")
    g = hf_model(**CASES["gemma3"], seed=2)
    path = write_gguf(g, tmp_path / "g.gguf", extra_kv={"gemma3.rope.scaling.type": "yarn",
                                                        "gemma3.rope.scaling.factor": 8.0})
    with pytest.raises(ModelFileError, match=r"RoPE scaling 'yarn' \(gemma3.rope.scaling.type\) is not supported "
                                             "for architecture 'gemma3'"):
        load_gguf(path, weights="f32")


def test_phi3_short_rope_factors_match_transformers(tmp_path):
    """Original context 48: a model run for 48 positions (``context=48``) uses the short factors, as HF on
    48 tokens; the default context (the file's 256) uses the long ones, as HF on 49 tokens or more. Those
    differ where HF has not yet switched (a 48-token sequence): the one difference (docs/DESIGN.md §21)."""
    model = hf_model(**{**CASES["phi3_longrope"], "original_max_position_embeddings": N,
                        "max_position_embeddings": 256}, seed=5)
    ids = np.random.default_rng(7).integers(3, model.config.vocab_size, N).tolist()
    f32, q8 = write_gguf(model, tmp_path / "f32.gguf"), write_gguf(model, tmp_path / "q8.gguf", quant="Q8_0")
    short_ref, long_ref = theirs(model, ids), theirs(model, ids + [5])[:N]
    m = load_gguf(f32, weights="f32")
    short, long = Transformer(m, context=N), Transformer(m)
    assert (short.rope_factors, long.rope_factors) == ("short", "long")
    assert rel_err(ours(short, ids), short_ref) <= 1e-3
    assert rel_err(ours(long, ids), long_ref) <= 1e-3
    assert rel_err(ours(long, ids), short_ref) > 0.05
    got = ours(Transformer(load_gguf(q8), context=N), ids)
    cos = (got * short_ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(short_ref, axis=-1))
    assert cos.min() >= 0.999


def test_phi3_rope_factors_come_as_a_pair_and_partial_rope_is_refused(tmp_path):
    """One longrope set without the other is refused, never run unscaled; so is RoPE on part of each head
    (Phi-4-mini: rope.dimension_count < head size), by name."""
    model = hf_model(**CASES["phi3_longrope"], seed=4)
    path = write_gguf(model, tmp_path / "one.gguf", drop_tensors=("rope_factors_short.weight",))
    with pytest.raises(ModelFileError, match=r"'rope_factors_long.weight' and 'rope_factors_short.weight' come "
                                             r"as a set; the file has only 'rope_factors_long.weight'"):
        load_gguf(path, weights="f32")                        # before any tensor is read
    with pytest.raises(ValueError, match=r"context must be a positive integer"):
        Transformer(load_gguf(write_gguf(model, tmp_path / "both.gguf"), weights="f32"), context=0)
    path = write_gguf(model, tmp_path / "partial.gguf", extra_kv={"phi3.rope.dimension_count": 16})
    with pytest.raises(ModelFileError, match=r"'phi3.rope.dimension_count' = 16 differs from the head size 32: "
                                             "RoPE on part of each head is not supported"):
        load_gguf(path, weights="f32")


@pytest.mark.parametrize("case", ["gemma2"], indirect=True)
def test_gemma2_soft_caps_are_what_makes_it_match(case):
    """Without either soft cap (the config as a loader that ignored its key would build it) the logits are
    far off: the comparison above does see both caps, the attention one in the compiled layers too."""
    name, model, f32, q8, ids = case
    ref = theirs(model, ids)
    for path in (f32, q8):
        m = load_gguf(path, weights="f32" if path == f32 else "quant")
        for cap in ("attn_softcap", "final_softcap"):
            uncapped = dataclasses.replace(m, config=dataclasses.replace(m.config, **{cap: None}))
            assert rel_err(ours(Transformer(uncapped), ids), ref) > 0.05, (path, cap)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    """``rope.scaling.type = linear``: every frequency divided by the factor, as HF's linear rope."""
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    model = hf_model(arch="llama", rope=rope, seed=3)
    path = write_gguf(model, tmp_path / "lin.gguf", extra_kv={"llama.rope.scaling.type": "linear",
                                                              "llama.rope.scaling.factor": 4.0})
    ids = np.random.default_rng(7).integers(3, model.config.vocab_size, N).tolist()
    assert rel_err(ours(Transformer(load_gguf(path, weights="f32")), ids), theirs(model, ids)) <= 1e-3


@pytest.mark.parametrize("mode, dtype", [("window", "float16"), ("sinks", "bfloat16"), ("full", "float16")])
def test_cache_kinds_run_every_architecture(case, mode, dtype):
    """16-bit caches, a window and sinks (both wider than the 48 positions, so the attention is the full
    one) on the packed path (compiled layers) and the float32 path: cosine >= 0.999 with transformers."""
    name, model, f32, q8, ids = case
    ref = theirs(model, ids)
    for path in (f32, q8):
        tf = Transformer(load_gguf(path, weights="f32" if path == f32 else "quant"))
        caches = tf.new_caches(batch=1, max_chunk=CHUNK, mode=mode, dtype=dtype,
                               window=None if mode == "full" else 60, sinks=4 if mode == "sinks" else 0)
        got = np.concatenate([tf.forward(np.array([ids[s:s + CHUNK]]), caches)[0] for s in range(0, N, CHUNK)])
        cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
        assert cos.min() >= 0.999, (path, cos.min())
