"""How much resident memory does a 64k-token causal SmolLM2-135M context take per cache dtype (issue 28)?

    PYTHONPATH=. python benchmarks/kv_quant_rss.py float16    # then q8_0, q4_0: one process each

The model's 30 causal caches are made as ``streamattn generate`` makes them and every one of the 65,536
slots is written (``write_sequence``, random rows quantized once), so every page is resident; the RSS
before (model loaded, quantizer compiled) and after is printed as JSON, with the K/V bytes the caches
allocate.
"""
import gc
import json
import sys

import numpy as np

from streamattn.gguf.hub import resolve_model
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer
from streamattn.kv.storage import to_storage

TOKENS = 65536


def rss_mb() -> float:
    """This process's resident set (VmRSS) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(dtype: str) -> dict:
    tf = Transformer(load_gguf(resolve_model(None, quiet=True)))
    to_storage(np.zeros((1, 64), np.float32), dtype, np)   # load the quantizer's compiled code before measuring
    before = rss_mb()
    caches = tf.new_caches(batch=1, mode="full", dtype=dtype, max_chunk=256)
    spec = caches[0].spec
    x = np.random.default_rng(0).standard_normal((spec.kv_heads, TOKENS, spec.head_dim)).astype(np.float32)
    rows = to_storage(x, dtype, np)                        # [kv_heads, TOKENS, width] as stored
    for c in caches:
        c.write_sequence(0, rows, rows, length=TOKENS)     # every slot written: the pages are resident
    del x, rows                                            # the staging arrays: only the caches stay
    gc.collect()
    after = rss_mb()
    return {"dtype": dtype, "tokens": TOKENS, "layers": len(caches), "kv_bytes": sum(c.nbytes for c in caches),
            "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_of_context_mb": round(after - before, 1)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "float16")))
