"""What one forward pass runs, and which of its logits come back (:meth:`Transformer.run`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Feed:
    """The input of one forward pass.

    Attributes
    ----------
    tokens : int array [B, T]
        New tokens; row b's first ``counts[b]`` entries are real, the rest padding. On the GPU, with the
        embedding kept packed there, a device array (a device argmax's ids) is read there, not uploaded;
        its ids are not checked on the host: one outside the vocabulary (any integer dtype) embeds as a
        NaN row, which the step's finite check refuses (ValueError, the caches unchanged) where a cache
        checks finiteness (``CacheSpec.check_finite``, the default; one layer's suffices, as the row
        reaches every layer); where none does, that row's logits are NaN and no error is raised.
    counts : int array [B] or None
        Real tokens per row (a ragged batch); None: all T.
    rows, cols : int arrays [N] or None
        Return the logits of these (row, token) positions only: [N, vocab] (an engine step needs a
        prompt chunk's last token but every token of a draft being verified). A position's logits are the
        same bits as in the full [B, T, vocab] result.
    last_only : bool
        Return each row's last real token's logits: [B, vocab] (``rows``/``cols`` then None).

    With neither ``rows`` nor ``last_only`` every position's logits come back: [B, T, vocab].
    """

    tokens: np.ndarray
    counts: np.ndarray | None = None
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    last_only: bool = False

    def __post_init__(self):
        if (self.rows is None) != (self.cols is None):
            raise ValueError("rows and cols go together: both index arrays [N], or neither")
        if self.last_only and self.rows is not None:
            raise ValueError("last_only returns each row's last token: it takes no rows/cols")
        if self.rows is not None and np.shape(self.rows) != np.shape(self.cols):
            raise ValueError(f"rows and cols must have one shape (got {np.shape(self.rows)} and "
                             f"{np.shape(self.cols)})")
