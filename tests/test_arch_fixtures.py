"""Our logits on GGUF files written by llama.cpp's own converter (tests/data/arch/, made once by
scripts/make_arch_fixtures.py from tiny seeded HF models; versions and command in fixtures.json) against
the logits HF transformers gave on them: max|ours - theirs| / max|theirs| <= 1e-3 at every position.

tests/test_hf_architectures.py writes its files with our own writer; a convention that writer and our
loader shared wrongly (Q/K row order, norm offsets, fused tensors, where RoPE factors live) would pass
there and fail here. No torch needed."""

import json
from pathlib import Path

import numpy as np
import pytest

from streamattn.gguf.loader import load_gguf
from oracle import rel_err
from streamattn.models.transformer import Transformer

DATA = Path(__file__).parent / "data" / "arch"
CASES = sorted(json.loads((DATA / "fixtures.json").read_text())["cases"])
ARCH = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen2_yarn": "qwen2", "qwen3": "qwen3",
        "phi3": "phi3", "phi3_longrope": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_architecture_has_a_fixture():
    assert set(CASES) == set(ARCH)


@pytest.mark.parametrize("weights", ["f32", "quant"])
@pytest.mark.parametrize("name", CASES)
def test_logits_on_the_converters_file_match_transformers(name, weights):
    ref = np.load(DATA / f"{name}.npz")
    m = load_gguf(DATA / f"{name}.gguf", weights=weights, tokenizer=False)     # placeholder tokens, no pre
    assert m.config.arch == ARCH[name]
    tf = Transformer(m)
    ids = ref["ids"].tolist()
    caches = tf.new_caches(batch=1, max_chunk=16)
    got = np.concatenate([tf.forward(np.array([ids[s:s + 16]]), caches)[0] for s in range(0, len(ids), 16)])
    err = rel_err(got, ref["logits"])
    print(f"\n{name} ({weights}): max rel err {err:.2e}")
    assert err <= 1e-3
