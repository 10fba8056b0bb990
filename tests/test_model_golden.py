"""Our float32 forward against golden logits of HF transformers, with no torch at test time.

transformers read the same GGUF files with its own dequantisation and its own handling of llama.cpp's
conventions (the Q/K row permutation for RoPE, Gemma's stored 1+w norms, the embedding scale, the
sliding-window layers); scripts/make_golden.py ran it once and stored, for a few positions, the top-32
logits and a few fixed ids (tests/data/golden_*.npz; command, versions and file checksums in
tests/data/golden.json). This test reads nothing from our model config: only token ids in, logits out.

Tolerance: max |ours - theirs| / max |theirs| <= 1e-4 over the stored logits (measured ~2e-6: both sides
dequantise the same blocks to float32 and run float32 arithmetic; docs/DESIGN.md §10), and our top-1 id
is theirs wherever their top two differ by more than that.
"""

import json
import os

import numpy as np
import pytest

from _model_util import gemma_path, load, need_gemma, need_smollm2, smollm2_path
from oracle import rel_err
from streamattn.gguf.hub import sha256_file

DATA = os.path.join(os.path.dirname(__file__), "data")
TOL = 1e-4   # measured 1.9e-6 (SmolLM2), 1.3e-6 (Gemma-3) on 2026-11-30
CHUNK = 64

pytestmark = pytest.mark.usefixtures("one_thread")


def golden(name):
    with open(os.path.join(DATA, "golden.json")) as f:
        record = json.load(f)
    return record, record["models"][name], np.load(os.path.join(DATA, f"golden_{name}.npz"))


def logits_at(tf, ids, positions):
    """Our logits [P, vocab] at ``positions``: the ids fed in chunks of <= CHUNK that end at each position."""
    caches = tf.new_caches(batch=1, max_chunk=CHUNK)
    ends = sorted(set(range(CHUNK, len(ids), CHUNK)) | {p + 1 for p in positions} | {len(ids)})
    out, start = {}, 0
    for end in ends:
        row = tf.forward(np.array([ids[start:end]]), caches, last_only=True)
        out[end - 1] = np.asarray(row, dtype=np.float32).reshape(-1)
        start = end
    return np.stack([out[p] for p in positions])


def compare(name, path):
    record, meta, g = golden(name)
    assert sha256_file(path) == meta["gguf_sha256"], "not the file the golden logits were made from"
    _, tf, _ = load(path)
    ours = logits_at(tf, g["ids"].tolist(), g["positions"].tolist())          # [P, vocab]
    theirs = np.concatenate([g["top_values"], g["fixed_values"]], axis=1)     # [P, 32 + F]
    cols = np.concatenate([g["top_ids"], np.broadcast_to(g["fixed_ids"], (len(ours), len(g["fixed_ids"])))], 1)
    got = np.take_along_axis(ours, cols, axis=1)
    rel = rel_err(got, theirs)
    clear = g["top_values"][:, 0] - g["top_values"][:, 1] > TOL * np.abs(theirs).max()
    top1 = ours.argmax(axis=1)
    print(f"\n{name}: {len(g['ids'])} tokens, positions {g['positions'].tolist()}, "
          f"max|diff|/max|logit| = {rel:.2e} (transformers {record['versions']['transformers']})")
    assert rel <= TOL, rel
    assert (top1[clear] == g["top_ids"][clear, 0]).all(), (top1, g["top_ids"][:, 0])
    return rel


@need_smollm2
def test_smollm2_matches_golden_transformers_logits():
    compare("smollm2", smollm2_path())


@need_gemma
def test_gemma3_matches_golden_transformers_logits_past_the_window():
    _, meta, g = golden("gemma3")
    assert g["positions"].max() > 512            # the sliding layers really slide
    compare("gemma3", gemma_path())
