"""Cases for the engine's contract on every entry point (tests/test_engine_contract.py, test_serve_http.py):
stop strings cut from a real greedy completion of SmolLM2, so that each spans a known number of tokens."""

from __future__ import annotations

import functools

PROMPT = "Write a short story about a robot who learns to paint."     # chat-wrapped everywhere
N_TOKENS = 48
SNOWMAN = "\u2603"                                                     # never in the completion


@functools.cache
def greedy(path: str) -> tuple:
    """(token ids, text, character offset of each token boundary) of the chat prompt's greedy completion
    with no stop strings, through the Python API on the CLI's default (packed) weights."""
    from _model_util import load
    from streamattn.engine.generate import Generator
    _, tf, tok = load(path, weights="quant")
    evs = list(Generator(tf, tok).stream(PROMPT, chat=True, max_tokens=N_TOKENS))
    ids = [e.token_id for e in evs]
    offsets = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    return tuple(ids), "".join(e.text for e in evs), tuple(offsets)


def stop_cases(path: str) -> list:
    """[(name, stop strings, expected text, expected finish)]: stop strings spanning 2, 3 and 5 tokens
    (each starting inside a token and ending inside another), a stop string that is a prefix of another,
    and one that starts like the text but never completes (held back, then released in full)."""
    ids, text, off = greedy(path)
    assert len(ids) == N_TOKENS and text.isascii(), "the case builder expects a 48-token ASCII completion"

    def spanning(k: int, n: int) -> str:                 # from inside token k to inside token k + n - 1
        a = off[k] + 1 if off[k + 1] - off[k] > 1 else off[k]
        b = off[k + n] - 1 if off[k + n] - off[k + n - 1] > 1 else off[k + n]
        return text[a:b]

    cases = []
    for name, k, n in (("2 tokens", 10, 2), ("3 tokens", 20, 3), ("5 tokens", 30, 5)):
        s = spanning(k, n)
        cases.append((name, (s,), text[:text.find(s)], "stop"))
    longer = spanning(14, 5)
    cases.append(("prefix of another", (longer, longer[:3]), text[:text.find(longer[:3])], "stop"))
    cases.append(("never completes", (spanning(24, 3) + SNOWMAN,), text, "length"))
    return cases
