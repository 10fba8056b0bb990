"""Make tests/data/arch/: one tiny GGUF per architecture written by llama.cpp's own converter, with the
logits HF transformers gives on it (tests/test_arch_fixtures.py checks ours against those).

Our tests' GGUF writer (tests/_hf_gguf.py) and our loader could share a wrong convention (Q/K row order,
norm offsets, fused tensors, where RoPE factors live) and still agree; files made by llama.cpp's
``convert_hf_to_gguf.py`` cannot. The converter comes from the llama.cpp sources vendored in the
``llama-cpp-python`` sdist (``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION``, then
untar ``*/vendor/llama.cpp/{convert_hf_to_gguf.py,conversion,gguf-py}``), run with its own gguf-py.

The tiny models have no tokenizer, so the converter's ``set_vocab`` (which reads one) is replaced by a
list of placeholder tokens (and Gemma's, which counts the rows of the embedding it keeps in
tokenizer.json, gets one of that size); every tensor and every other key is the converter's own.

    python3 scripts/make_arch_fixtures.py LLAMA_CPP_DIR SDIST_VERSION [NAME ...]   # torch, transformers
    python3 scripts/make_arch_fixtures.py /tmp/llama_cpp_python-0.3.36/vendor/llama.cpp 0.3.36
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "arch"
sys.path.insert(0, str(ROOT / "tests"))

N = 48
#: name -> hf_model arguments: hidden 64, 2 layers, 4 heads / 2 kv, vocab 320 unless said.
SMALL = dict(hidden=64, ffn=128)
CASES = {
    "llama3": dict(arch="llama", rope={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32}),
    # no window: the converter does not write Mistral's (v0.1: 4096), so no file can say it slides
    "mistral": dict(arch="mistral", sliding_window=None),
    "qwen2": dict(arch="qwen2", tied=True, rope={"rope_type": "default", "rope_theta": 1e6}),
    # YaRN as Qwen2.5 past 32k, from 64 to 256 positions: the ramp over dimensions 0..2 of 8 at head size 16
    "qwen2_yarn": dict(arch="qwen2", tied=True, rope={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64}),
    "qwen3": dict(arch="qwen3", head_dim=32, tied=True, rope={"rope_type": "default", "rope_theta": 1e6}),
    "phi3": dict(arch="phi3", sliding_window=16, pad_token_id=0),
    # su/longrope: the long factors (HF: a sequence longer than 8; ours: the file's context 256 > 8) and
    # the attention factor sqrt(1 + ln(256 / 8) / ln 8) that the converter computes and writes
    "phi3_longrope": dict(arch="phi3", sliding_window=16, pad_token_id=0, original_max_position_embeddings=8,
                          rope={"rope_type": "longrope", "rope_theta": 10000.0,
                                "long_factor": [1.0, 1.5748, 2.48, 3.9055, 6.1503, 9.6855, 15.2526, 24.0],
                                "short_factor": [1.0, 1.0714, 1.1429, 1.2143, 1.2857, 1.3571, 1.4286, 1.5]}),
    # alternating sliding (window 8) / global; caps that bind on these scores and logits
    "gemma2": dict(arch="gemma2", layers=4, ffn=64, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   tied=True, attn_logit_softcapping=1.5, final_logit_softcapping=12.0),
    "gemma3": dict(arch="gemma3", layers=6, ffn=64, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                   rope={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}),
}

RUNNER = r"""
import sys
from pathlib import Path
llama_cpp = Path(sys.argv[1])
sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
import gguf
import conversion
from conversion import base


def placeholder_vocab(self):
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_token_list([f"t{i}" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_bos_token_id(1)
    self.gguf_writer.add_eos_token_id(2)


def every_subclass(c):
    for s in c.__subclasses__():
        yield s
        yield from every_subclass(s)


import pkgutil, importlib
for m in pkgutil.iter_modules(conversion.__path__):
    importlib.import_module("conversion." + m.name)
for cls in [base.TextModel, *every_subclass(base.TextModel)]:
    if "set_vocab" in vars(cls):
        cls.set_vocab = placeholder_vocab
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
sys.path.insert(0, str(llama_cpp))
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def main(llama_cpp: str) -> None:
    import torch
    import transformers
    from _hf_gguf import hf_model
    OUT.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(7).integers(3, 320, N)
    made = {}
    only = sys.argv[3:]                     # names to make again (default: all)
    for name, kw in CASES.items():
        if only and name not in only:
            continue
        model = hf_model(**{**SMALL, **kw}, seed=11)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            # what Gemma's converter reads of a tokenizer besides set_vocab: the vocabulary's size
            (Path(d) / "tokenizer.json").write_text(json.dumps(
                {"model": {"vocab": {f"t{i}": i for i in range(model.config.vocab_size)}}, "added_tokens": []}))
            cmd = [sys.executable, "-c", RUNNER, llama_cpp, d, "--outtype", "f32", "--outfile",
                   str(OUT / f"{name}.gguf")]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{name}: the converter failed:\n{done.stderr[-3000:]}")
        with torch.no_grad():
            logits = model(torch.tensor([ids.tolist()])).logits[0].float().numpy()
        np.savez_compressed(OUT / f"{name}.npz", ids=ids.astype(np.int64), logits=logits.astype(np.float32))
        made[name] = {"hf_class": type(model).__name__, "hf_model": {**SMALL, **kw}, "seed": 11,
                      "bytes": (OUT / f"{name}.gguf").stat().st_size}
        print(name, made[name]["bytes"], "bytes")
    version = subprocess.run(["git", "-C", llama_cpp, "describe", "--always"], capture_output=True,
                             text=True).stdout.strip()
    old = json.loads((OUT / "fixtures.json").read_text())["cases"] if (OUT / "fixtures.json").exists() else {}
    made = {**old, **made}
    (OUT / "fixtures.json").write_text(json.dumps({
        "made_by": "python3 scripts/make_arch_fixtures.py LLAMA_CPP_DIR SDIST_VERSION (see its docstring)",
        "converter": "convert_hf_to_gguf.py --outtype f32 from the llama.cpp vendored in llama-cpp-python "
                     f"{sys.argv[2] if len(sys.argv) > 2 else '0.3.36'} sdist" + (f" ({version})" if version else ""),
        "vocabulary": "set_vocab replaced by placeholder tokens t0..t319 (the tiny models have no tokenizer)",
        "torch": torch.__version__, "transformers": transformers.__version__, "tokens": N,
        "logits": "HF transformers forward, float32, eager attention, every position", "cases": made,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
