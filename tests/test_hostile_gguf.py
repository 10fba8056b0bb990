"""Small GGUF files that asked for large work (issue 29 group 5): the work a load does is bounded by what
the model uses, and every refusal comes before the large allocation."""

import os
import resource
import struct
import time

import numpy as np
import pytest

from _model_util import write_tiny_gguf
from streamattn.gguf.reader import MAX_ARRAY_ITEMS, GGUFFile
from streamattn.gguf.loader import ModelFileError, load_gguf


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_unused_tensor_is_refused_unread(tmp_path, monkeypatch):
    """A TQ1_0 tensor the model does not use (16.7M weights in 3.5 MB; dequantized: 67 MB) is refused by
    name (running without it would run another model), before any tensor is read."""
    import gguf.quants
    rows = 1 << 16
    raw = np.zeros((rows, 54), np.uint8)                          # one 256-weight block a row
    path = write_tiny_gguf(tmp_path / "m.gguf", extra_tensors={"unused.weight": (raw, "TQ1_0")})
    seen = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: (seen.append(qtype.name), real(data, qtype))[1])
    for weights in ("quant", "f32"):
        with pytest.raises(ModelFileError, match="tensor 'unused.weight' is not used by architecture 'gemma3'"):
            load_gguf(path, weights=weights)
    assert seen == []                                                # refused before any tensor is read


def _header_with_array(path, etype: int, count: int, item: bytes) -> None:
    key = b"tokenizer.ggml.tokens"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, etype,
                                                                                                   count)
    with open(path, "wb") as f:
        f.write(head)
        f.write(item * count)


@pytest.mark.parametrize("etype, item", [(0, b"\x01"), (8, struct.pack("<Q", 1) + b"a")])
def test_a_huge_metadata_array_is_refused_by_its_count(tmp_path, etype, item):
    """2^20 + 1 one-byte numbers (1 MB) or 1-character strings (9.4 MB): refused naming the key, before
    a Python object is made for any item (a 60M-item array used to cost 2.58 GB)."""
    path = tmp_path / "a.gguf"
    _header_with_array(path, etype, MAX_ARRAY_ITEMS + 1, item)
    before = peak_mb()
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"metadata key 'tokenizer.ggml.tokens': array of {MAX_ARRAY_ITEMS + 1} "
                                         rf"values, more than the {MAX_ARRAY_ITEMS}"):
        GGUFFile(str(path))
    with pytest.raises(ModelFileError, match="array of"):
        load_gguf(str(path))
    assert time.perf_counter() - t0 < 2 and peak_mb() - before < 100


def test_a_vocabulary_that_does_not_match_the_embedding_is_refused_before_the_weights(tmp_path, monkeypatch):
    """200 000 tokens (a ~2 MB vocabulary) in front of a 64-row embedding: refused from the tensor infos,
    before any tensor is read (it took 12 s and 0.97 GB)."""
    import gguf.quants
    path = write_tiny_gguf(tmp_path / "v.gguf", tokens=[f"w{i}" for i in range(200_000)])
    assert os.path.getsize(path) > 2_000_000
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("a tensor was read"))
    t0 = time.perf_counter()
    with pytest.raises(ModelFileError, match=r"tensor 'token_embd.weight' has shape \(64, 32\), expected "
                                             r"\(200000, 32\)"):
        load_gguf(path, weights="f32")
    assert time.perf_counter() - t0 < 5


def test_a_model_path_that_is_a_fifo_or_device_is_refused(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    for p, kind in ((str(fifo), "a FIFO"), ("/dev/zero", "a character device")):
        with pytest.raises(ModelFileError, match=f"is {kind}"):
            load_gguf(p)
