"""Our tokenizer against llama.cpp's vocabulary test files: ids equal to those HF transformers gave.

    PYTHONPATH=. python scripts/check_vocab_files.py [DIR]

DIR (default: .peer/llamacpp-native/src/models, the llama.cpp sources scripts/install_llamacpp_native.sh
unpacks) holds llama.cpp's ggml-vocab-NAME.gguf files (a real model's tokenizer metadata, no weights)
with NAME.gguf.inp (test texts separated by "\\n__ggml_vocab_test__\\n") and NAME.gguf.out (one line of
ids per text, written by llama.cpp's convert_hf_to_gguf_update.py from the model's own HF tokenizer,
``encode(text, add_special_tokens=False)``). Prints, per file, the refusal or how many texts agree, and
exits 1 if a tokenizer we accept disagrees on any text.
"""

import sys
from pathlib import Path

from streamattn.gguf.loader import open_container
from streamattn.gguf.metadata import read_metadata
from streamattn.text.tokenizer import Tokenizer


def main():
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".peer/llamacpp-native/src/models")
    files = sorted(f for f in folder.glob("ggml-vocab-*.gguf") if f.with_suffix(".gguf.inp").exists())
    if not files:
        sys.exit(f"no ggml-vocab-*.gguf with .inp/.out files in {folder}")
    wrong = 0
    for f in files:
        md = read_metadata(open_container(str(f)), str(f))
        what = f"{f.name}: model={md.get('tokenizer.ggml.model')!r} pre={md.get('tokenizer.ggml.pre')!r}"
        try:
            tok = Tokenizer.from_metadata(md)
        except ValueError as e:
            print(f"{what}: refused ({str(e)[:90]})")
            continue
        texts = f.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        outs = f.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
        bad = [t for t, o in zip(texts, outs)
               if tok.encode(t, add_bos=False, add_eos=False) != [int(v) for v in o.split()]]
        wrong += len(bad)
        n = min(len(texts), len(outs))
        other = f"; first other: {bad[0][:40]!r}" if bad else ""
        print(f"{what}: {n - len(bad)}/{n} texts give the same ids{other}")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
