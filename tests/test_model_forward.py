"""The cached, chunked forward pass against an independent float64 full-recompute oracle.

The oracle below recomputes the whole sequence from scratch at every check (no cache, no chunks),
with RoPE written as complex rotations and the window mask written from the docs/DESIGN.md §1 table. The
model under test streams tokens through ring caches: equality means the cache/positions/RoPE/window
bookkeeping is exact, including ring wrap-around.
"""

import numpy as np
import pytest

from _model_util import load, need_smollm2, smollm2_path, write_tiny_gguf
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer
from streamattn.kv.reference import attention

pytestmark = pytest.mark.usefixtures("one_thread")


def oracle_logits(m, tokens, *, user_window=None, sinks=0, hidden=False):
    """float64 logits [T, vocab] of one sequence, recomputed from scratch (``hidden``: the final hidden
    states [T, d] instead, after the output norm)."""
    c, W = m.config, {k: v.astype(np.float64) for k, v in m.weights.items()}
    T, hd, H, Hk = len(tokens), c.head_dim, c.n_heads, c.n_kv_heads
    norm = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * w  # noqa: E731
    pos = np.arange(T)
    x = W["token_embd.weight"][tokens] * c.embed_scale
    for i in range(c.n_layers):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        if p + "attn_qkv.weight" in W:                                     # phi3: one fused matrix
            qkv = h @ W[p + "attn_qkv.weight"].T
            q, k, v = np.split(qkv, [H * hd, (H + Hk) * hd], axis=-1)
        else:
            q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
        q, k, v = q.reshape(T, H, hd), k.reshape(T, Hk, hd), v.reshape(T, Hk, hd)
        if c.qk_norm:
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        own = c.layer_windows[i]
        base = c.rope_base if own is None else c.rope_base_local
        inv = base ** (-np.arange(hd // 2) * 2 / hd)                                          # [hd/2]
        if base == c.rope_base:                   # scaling: the global base's (llama3 divisors, linear)
            inv = inv / (W.get("rope_freqs.weight", 1.0) * c.rope_linear)
        rot = np.exp(1j * pos[:, None, None] * inv)                                         # [T, 1, hd/2]

        def rope(a):
            if c.rope_style == "interleaved":
                z = (a[..., 0::2] + 1j * a[..., 1::2]) * rot
                out = np.empty_like(a)
                out[..., 0::2], out[..., 1::2] = z.real, z.imag
                return out
            z = (a[..., : hd // 2] + 1j * a[..., hd // 2:]) * rot
            return np.concatenate([z.real, z.imag], -1)

        q, k = rope(q), rope(k)
        win = own if user_window is None else (user_window if own is None else min(own, user_window))
        jj, ii = np.meshgrid(pos, pos)
        sinks_here = sinks if user_window and (own is None or user_window < own) else 0   # as new_caches
        vis = (jj <= ii) if win is None else (jj <= ii) & ((jj > ii - win) | (jj < sinks_here))
        G = H // Hk
        o = np.empty((T, H, hd))
        for head in range(H):
            s = q[:, head] @ k[:, head // G].T * c.attn_scale
            s = np.where(vis, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            o[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, head // G]
        a = o.reshape(T, H * hd) @ W[p + "attn_output.weight"].T
        if c.post_norms:
            a = norm(a, W[p + "post_attention_norm.weight"])
        x = x + a
        h = norm(x, W[p + "ffn_norm.weight"])
        if p + "ffn_gate.weight" in W:
            g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        else:                                                              # phi3: ffn_up holds gate, up
            g, u = np.split(h @ W[p + "ffn_up.weight"].T, 2, axis=-1)
        act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if c.activation == "gelu_tanh" \
            else g / (1 + np.exp(-g))
        f = (act * u) @ W[p + "ffn_down.weight"].T
        if c.post_norms:
            f = norm(f, W[p + "post_ffw_norm.weight"])
        x = x + f
    out = W.get("output.weight", W["token_embd.weight"])
    h = norm(x, W["output_norm.weight"])
    return h if hidden else h @ out.T


def stream_logits(tf, tokens, *, chunk, mode="full", window=None, sinks=0):
    caches = tf.new_caches(batch=1, mode=mode, window=window, sinks=sinks, max_chunk=chunk)
    outs = [tf.forward(np.array([tokens[s:s + chunk]]), caches)[0] for s in range(0, len(tokens), chunk)]
    return np.concatenate(outs)


@pytest.mark.parametrize("weights", ["f32", "quant"])
@pytest.mark.parametrize("arch,chunk,mode,window,sinks", [
    ("gemma3", 1, "full", None, 0),       # gemma's own window of 4 on 5 of 6 layers, ring wraps many times
    ("gemma3", 3, "full", None, 0),
    ("gemma3", 5, "sinks", 6, 2),         # user window + sinks on the global layer; local layers as trained
    ("gemma3", 2, "sinks", 3, 1),         # a user window under gemma's own: every layer takes it, with sinks
    ("llama", 1, "full", None, 0),
    ("llama", 4, "window", 5, 0),
    ("llama", 7, "sinks", 4, 3),
])
def test_streamed_forward_equals_full_recompute(tmp_path, arch, chunk, mode, window, sinks, weights):
    """Both weight paths: float32 arrays, and the packed-kernel path (the tiny file's F32 matrices)."""
    path = write_tiny_gguf(tmp_path / "t.gguf", arch=arch, n_kv_heads=2 if arch == "llama" else 1)
    m = load_gguf(path, weights="f32")
    tf = Transformer(load_gguf(path, weights=weights))
    tokens = list(np.random.default_rng(1).integers(0, m.config.vocab_size, 23))
    got = stream_logits(tf, tokens, chunk=chunk, mode=mode, window=window, sinks=sinks)
    want = oracle_logits(m, tokens, user_window=window, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("weights", ["f32", "quant"])
@pytest.mark.parametrize("arch,chunk,mode,window,sinks", [
    ("llama+rope_freqs", 3, "full", None, 0),   # llama3 scaling: per-dimension divisors
    ("llama+rope_freqs", 2, "sinks", 4, 2),
    ("qwen2", 1, "full", None, 0),              # q/k/v biases
    ("qwen2", 5, "sinks", 6, 2),
    ("qwen3", 4, "window", 5, 0),               # per-head q/k norms
    ("phi3", 3, "full", None, 0),               # fused qkv and gate/up, every layer sliding (window 4)
    ("phi3", 2, "sinks", 3, 1),
])
def test_more_architectures_stream_equal_to_full_recompute(tmp_path, arch, chunk, mode, window, sinks, weights):
    arch, _, extra = arch.partition("+")
    path = write_tiny_gguf(tmp_path / "t.gguf", arch=arch, n_kv_heads=2, rope_freqs=extra == "rope_freqs")
    m = load_gguf(path, weights="f32")
    tf = Transformer(load_gguf(path, weights=weights))
    tokens = list(np.random.default_rng(1).integers(0, m.config.vocab_size, 23))
    got = stream_logits(tf, tokens, chunk=chunk, mode=mode, window=window, sinks=sinks)
    want = oracle_logits(m, tokens, user_window=window, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("weights", ["f32", "quant"])
@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen3", "phi3"])
def test_hidden_states_equal_full_recompute(tmp_path, arch, weights):
    """``hidden_states`` (embeddings' input): the oracle's final hidden states, whatever the chunk."""
    path = write_tiny_gguf(tmp_path / "t.gguf", arch=arch, n_kv_heads=2 if arch != "gemma3" else 1)
    m = load_gguf(path, weights="f32")
    tf = Transformer(load_gguf(path, weights=weights))
    tokens = np.random.default_rng(1).integers(0, m.config.vocab_size, 23)
    got = tf.hidden_states(tokens, chunk=5)
    want = oracle_logits(m, list(tokens), hidden=True)
    assert got.shape == (23, m.config.d_model) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    for chunk in (1, 23, 64):
        np.testing.assert_allclose(tf.hidden_states(tokens, chunk=chunk), got, rtol=1e-5, atol=1e-5)


def test_hidden_states_argument_errors(tmp_path):
    tf = Transformer(load_gguf(write_tiny_gguf(tmp_path / "t.gguf")))
    for bad in (np.array([[1, 2]]), np.array([], np.int64), np.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="tokens must be a non-empty 1-D array of token ids"):
            tf.hidden_states(bad)
    with pytest.raises(ValueError, match="token ids must be in 0..63"):
        tf.hidden_states(np.array([1, 64]))
    with pytest.raises(ValueError, match=r"chunk must be an integer >= 1 \(got 0\)"):
        tf.hidden_states(np.array([1]), chunk=0)


def test_ragged_batch_equals_single_sequences(tmp_path):
    m = load_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    tf = Transformer(m)
    rng = np.random.default_rng(2)
    seqs = [list(rng.integers(0, 64, n)) for n in (3, 11, 7)]
    caches = tf.new_caches(batch=3, max_chunk=4)
    done, got = [0, 0, 0], [[], [], []]
    while any(d < len(s) for d, s in zip(done, seqs)):
        cnt = np.array([min(4, len(s) - d) for d, s in zip(done, seqs)])
        toks = np.zeros((3, int(cnt.max())), np.int64)
        for b in range(3):
            toks[b, :cnt[b]] = seqs[b][done[b]:done[b] + cnt[b]]
        lg = tf.forward(toks, caches, counts=cnt)
        for b in range(3):
            got[b] += list(lg[b, :cnt[b]])
            done[b] += int(cnt[b])
    for b in range(3):
        single = stream_logits(tf, seqs[b], chunk=4)
        np.testing.assert_allclose(np.array(got[b]), single, rtol=1e-5, atol=1e-5)


def test_forward_argument_errors(tmp_path):
    tf = Transformer(load_gguf(write_tiny_gguf(tmp_path / "t.gguf")))
    caches = tf.new_caches(batch=1)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, T\]"):
        tf.forward(np.array([1, 2]), caches)
    with pytest.raises(ValueError, match="token ids must be in 0..63"):
        tf.forward(np.array([[64]]), caches)
    with pytest.raises(ValueError, match="one per layer"):
        tf.forward(np.array([[1]]), caches[:2])
    for bad in (np.array([1, 1]), np.array([2]), np.array([-1]), np.array([1.0]), [[1], [1, 1]], np.array([True])):
        with pytest.raises(ValueError, match=r"counts must be an int array of shape \(1,\) in 0..T=1 \(got "):
            tf.forward(np.array([[1]]), caches, counts=bad)       # [1, 1]: every value T, the wrong length
    assert [int(k.lengths[0]) for k in caches] == [0] * len(caches)
    with pytest.raises(ValueError, match="mode='window' needs window >= 1"):
        tf.new_caches(mode="window")
    with pytest.raises(ValueError, match="mode must be one of"):
        tf.new_caches(mode="ring")


@need_smollm2
def test_smollm2_window_layers_match_oracle_over_full_history():
    """window < sequence: every layer's attention output equals the float64 oracle over the whole
    K/V history with the window (+sinks) mask, at every step of a chunked prefill and a decode."""
    _, tf, tok = load(smollm2_path())
    window, sinks, chunk = 8, 2, 5
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and then it runs far away into the woods.")
    assert len(ids) > 2 * window
    caches = tf.new_caches(batch=1, mode="sinks", window=window, sinks=sinks, max_chunk=chunk)
    hist = {i: [np.zeros((tf.config.n_kv_heads, 0, tf.config.head_dim))] * 2 for i in range(tf.config.n_layers)}
    checked = []

    def hook(i, q, k, v, o):
        K = hist[i][0] = np.concatenate([hist[i][0], k[0]], 1)
        V = hist[i][1] = np.concatenate([hist[i][1], v[0]], 1)
        T = q.shape[2]
        if i % 7 == 0:                                              # sampled layers, every step
            want, _ = attention(q[0], K, V, np.arange(K.shape[1] - T, K.shape[1]), window=window, sinks=sinks,
                                scale=tf.config.attn_scale)
            np.testing.assert_allclose(o[0], want, rtol=1e-4, atol=1e-5)
            checked.append((i, K.shape[1]))

    for s in range(0, len(ids), chunk):
        logits = tf.forward(np.array([ids[s:s + chunk]]), caches, attn_hook=hook, last_only=True)
    for _ in range(4):
        logits = tf.forward(np.array([[int(np.argmax(logits[0]))]]), caches, attn_hook=hook, last_only=True)
    assert max(n for _, n in checked) == len(ids) + 4


@need_smollm2
@pytest.mark.parametrize("mode,window,sinks", [("window", 64, 0), ("sinks", 60, 4)])
def test_smollm2_window_larger_than_sequence_equals_full(mode, window, sinks):
    from streamattn.engine.generate import Generator
    _, tf, tok = load(smollm2_path())
    prompt = "List three colours of the rainbow:"
    full = [e.token_id for e in Generator(tf, tok, prefill_chunk=8).stream(prompt, max_tokens=16)]
    win = [e.token_id for e in Generator(tf, tok, cache=mode, window=window, sinks=sinks, prefill_chunk=8)
           .stream(prompt, max_tokens=16)]
    assert len(tok.encode(prompt)) + 16 < window
    assert win == full
