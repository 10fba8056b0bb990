"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty; seeded numpy RNG.

Order of operations (as in llama.cpp / HF): repetition penalty on the raw logits, then temperature,
then the top-k / top-p / min-p filters on the resulting distribution, then one draw. ``temperature=0``
means greedy (argmax after the repetition penalty); the filters then do nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_TEMPERATURE = 1e-5      # below it (but > 0) logits / temperature overflow float64: refused


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Parameters
    ----------
    temperature : float
        0 = greedy; otherwise a finite number >= ``MIN_TEMPERATURE`` (1e-5) that divides the logits.
    top_k : int
        Keep the k most likely tokens (0 = off).
    top_p : float
        Keep the smallest set whose probability reaches p (1.0 = off).
    min_p : float
        Drop tokens whose probability is below ``min_p * p_max`` (0 = off).
    repetition_penalty : float
        > 1 discourages tokens already in the context (CTRL rule: positive logits divided, negative
        multiplied); 1.0 = off.
    seed : int or None
        Seed of the numpy Generator, an integer in [0, 2**63) (None: fresh entropy).

    Every field is checked here (type, range, finite), so a bad value fails when the parameters are
    built, never in the middle of decoding.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number (got {str(v)[:40]!r})")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature):
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (got {self.temperature})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None (got {str(self.seed)[:40]!r})")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (got {self.top_k!r}); 0 disables it")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); 1.0 disables it")
        if not (0 <= self.min_p < 1):
            raise ValueError(f"min_p must be in [0, 1) (got {self.min_p}); 0 disables it")
        if not (self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 (got {self.repetition_penalty}); 1.0 disables it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits, seen, penalty: float):
    """Penalise ids in ``seen`` (int array) in a copy of ``logits`` [vocab]."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    logits = logits.copy()
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    x = logits[ids]
    logits[ids] = np.where(x > 0, x / penalty, x * penalty)
    return logits


def filtered_probs(logits, p: SamplingParams):
    """Probabilities [vocab] (float64) after temperature, top-k, top-p and min-p."""
    z = logits.astype(np.float64) / p.temperature
    z -= z.max()
    if p.top_k and p.top_k < z.shape[0]:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z >= kth, z, -np.inf)
    probs = np.exp(z)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        csum = np.cumsum(probs[order])
        keep = csum - probs[order] < p.top_p * csum[-1]     # smallest prefix reaching top_p (first always kept)
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
    return probs / probs.sum()


def sample(logits, params: SamplingParams, rng: np.random.Generator, seen=()) -> int:
    """Pick one token id from ``logits`` [vocab] (numpy float); ``seen``: ids for the repetition penalty.

    Examples
    --------
    >>> sample(np.array([0.1, 3.0, 0.2]), SamplingParams(), np.random.default_rng(0))
    1
    """
    logits = np.asarray(logits)
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(rng.choice(probs.shape[0], p=probs))


def add_arguments(p) -> None:
    """The sampling flags shared by ``streamattn generate`` and ``streamattn batch`` (an argparse parser)."""
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="new tokens at most")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
