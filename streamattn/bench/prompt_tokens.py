"""A prompt cut to a token count, so that engines timed on text and a benchmark timed on a count agree.

    python -m streamattn.bench.prompt_tokens MODEL.gguf PROMPT.txt 512     # JSON: {"text", "tokens"}

llama-bench times the prefill of ``-p N`` tokens; streamattn and node-llama-cpp take text. The text given
to them is the longest prefix of the prompt file, ending at a whitespace boundary, that the model's own
tokenizer turns into at most N tokens (BOS included, as the engines count it): N exactly, or one or two
fewer where the next word would span the limit. The count is reported, not assumed.

:func:`cut` takes any encoder (tested without a model); :func:`main` loads the GGUF's tokenizer, so it
imports streamattn: benchmarks/peer_llamacpp.py runs it in a child process, keeping Numba out of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def cut(text: str, n_tokens: int, encode) -> tuple:
    """The longest whitespace-bounded prefix of ``text`` that ``encode`` turns into at most ``n_tokens``.

    Parameters
    ----------
    text : str
        The whole prompt.
    n_tokens : int
        The token budget, >= 1.
    encode : callable
        str -> list of token ids (the engine's count, BOS included).

    Returns
    -------
    (prefix, count): the prefix (``text`` itself when it fits whole) and ``len(encode(prefix))``.

    Raises
    ------
    ValueError
        ``n_tokens`` < 1, or not even the first word fits.

    Examples
    --------
    >>> cut("a b c d", 3, lambda s: ["<s>"] + s.split())
    ('a b', 3)
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1 (got {n_tokens})")
    whole = len(encode(text))
    if whole <= n_tokens:
        return text, whole
    ends = [m.start() for m in re.finditer(r"\s+", text)]      # a prefix ends before a run of whitespace
    lo, hi, best = 0, len(ends) - 1, None
    while lo <= hi:                       # token counts grow with the prefix: bisect on the word boundaries
        mid = (lo + hi) // 2
        count = len(encode(text[:ends[mid]]))
        if count <= n_tokens:
            best, lo = (text[:ends[mid]], count), mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ValueError(f"the first word of the prompt is already more than {n_tokens} tokens; give a larger count")
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="GGUF whose tokenizer counts the tokens")
    p.add_argument("prompt", help="text file")
    p.add_argument("tokens", type=int, help="token budget (BOS included)")
    args = p.parse_args(argv)
    from streamattn.gguf.loader import open_container
    from streamattn.gguf.metadata import read_metadata
    from streamattn.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(read_metadata(open_container(args.model), args.model))
    with open(args.prompt, encoding="utf-8") as f:
        text, count = cut(f.read(), args.tokens, tok.encode)
    print(json.dumps({"text": text, "tokens": count}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
