"""The packed-weight path on the real model: agreement with the float32 reference, batch invariance."""

import numba
import numpy as np
import pytest

from _model_util import load, need_smollm2, smollm2_path

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("The Roman Republic was the era of classical Roman civilisation beginning with the overthrow of the "
        "Roman Kingdom, traditionally dated to 509 BC, and ending in 27 BC with the establishment of the Roman "
        "Empire following the War of Actium. During this period, Rome's control expanded from the city's "
        "immediate surroundings to hegemony over the entire Mediterranean world. Roman society at the time was "
        "primarily a cultural mix of Latin and Etruscan societies, as well as of Sabine, Oscan, and Greek "
        "cultural elements, which is especially visible in the ancient Roman religion and its pantheon. Its "
        "political organisation developed at around the same time as direct democracy in Ancient Greece, with "
        "collective and annual magistracies, overseen by a senate.")

# Stated tolerances of the quantized path against float32 (teacher-forced logits; measured 2026-11-30 on
# this text: SmolLM2 max 1.29, rms 0.20 (logit std 6.7); 6 of 146 argmax differ, all at f32 margins < 0.2;
# after the attention kernel moved to a fixed reduction grid, the same count at other last bits: max 1.20,
# rms 0.22, 6 of 146 differ at f32 margins 0.008-0.60). An argmax may differ only where the f32 top-2
# margin is within a logit (the size of the deviations themselves).
MAX_ABS, RMS, MARGIN = 2.5, 0.3, 1.0


def teacher_forced(tf, ids):
    return tf.forward(np.array([ids]), tf.new_caches(max_chunk=len(ids)))[0]          # [T, vocab]


@need_smollm2
def test_quant_path_agrees_with_f32_reference():
    _, ref, tok = load(smollm2_path())                       # the float32 reference (shared with other tests)
    _, q, _ = load(smollm2_path(), "quant")
    ids = tok.encode(TEXT)
    assert len(ids) >= 128
    lf, lq = teacher_forced(ref, ids), teacher_forced(q, ids)
    diff = np.abs(lf - lq)
    assert diff.max() <= MAX_ABS and np.sqrt((diff ** 2).mean()) <= RMS
    top2 = np.sort(lf, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    differ = lf.argmax(-1) != lq.argmax(-1)
    assert np.all(margin[differ] < MARGIN), margin[differ]
    assert differ.mean() < 0.1


def _decode(tf, seqs, steps, threads, chunk=4):
    """Prefill each sequence (ragged, in chunks of ``chunk``) then greedy-decode ``steps`` tokens for all;
    logits per sequence: [prompt + steps, vocab] arrays."""
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        B = len(seqs)
        caches = tf.new_caches(batch=B, max_chunk=16)
        out, done = [[] for _ in seqs], [0] * B
        while any(d < len(s) for d, s in zip(done, seqs)):
            cnt = np.array([min(chunk, len(s) - d) for d, s in zip(done, seqs)])
            toks = np.zeros((B, max(1, int(cnt.max()))), np.int64)
            for b in range(B):
                toks[b, :cnt[b]] = seqs[b][done[b]:done[b] + cnt[b]]
            lg = tf.forward(toks, caches, counts=np.maximum(cnt, 0))
            for b in range(B):
                if cnt[b]:
                    out[b].append(lg[b, :cnt[b]])
                done[b] += int(cnt[b])
        nxt = np.array([[o[-1][-1].argmax()] for o in out])
        for _ in range(steps):
            lg = tf.forward(nxt, caches)[:, 0]
            for b in range(B):
                out[b].append(lg[b:b + 1])
            nxt = lg.argmax(-1)[:, None]
        return [np.concatenate(o) for o in out]
    finally:
        numba.set_num_threads(before)


@need_smollm2
def test_logits_bit_identical_alone_in_a_ragged_batch_and_over_threads():
    _, tf, tok = load(smollm2_path(), "quant")
    a = tok.encode("The history of Rome")
    others = [tok.encode("Once upon a time, in a land far away, there lived"), tok.encode("2 + 2 =")]
    alone = _decode(tf, [a], 3, threads=1)[0]
    batched = _decode(tf, [others[0], a, others[1]], 3, threads=1)[1]
    np.testing.assert_array_equal(batched, alone)
    if numba.config.NUMBA_NUM_THREADS >= 2:
        np.testing.assert_array_equal(_decode(tf, [others[0], a, others[1]], 3, threads=2)[1], alone)


@need_smollm2
def test_logits_bit_identical_whatever_the_prefill_chunking():
    """The server's prompt cache computes a prompt's last token alone after restoring the rest, where a cold
    request computes it inside its prefill chunk: the logits (and so the greedy text) must be the same
    bits. With packed weights a last-bit difference in attention flipped an 8-bit activation rounding and
    changed the text at the 4th token (before the attention kernel reduced on a fixed grid)."""
    _, tf, tok = load(smollm2_path(), "quant")
    a = tok.encode("The sky is blue because the air scatters")
    whole = _decode(tf, [a], 4, threads=1, chunk=len(a))[0]
    np.testing.assert_array_equal(_decode(tf, [a], 4, threads=1, chunk=1)[0], whole)
    other = tok.encode("Once upon a time, in a land far away")
    np.testing.assert_array_equal(_decode(tf, [other, a], 4, threads=2, chunk=3)[1], whole)
