"""Token-by-token generation: chunked prefill, sampling, stop rules, ragged batches, per-step timing.

>>> gen = Generator(Transformer(m), Tokenizer.from_metadata(m.metadata))          # doctest: +SKIP
>>> for ev in gen.stream("The capital of France is", max_tokens=8):
...     print(ev.text, end="", flush=True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from streamattn.arrays import to_host
from streamattn.models.transformer import Transformer
from streamattn.models.sampling import SamplingParams, sample
from streamattn.text.tokenizer import StreamDecoder, Tokenizer


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    seq : index of the prompt in the batch; step : 0-based index of the token in its completion;
    token_id / text : the token and the text it completes (may be '' mid-character);
    step_s : wall seconds of the forward+sample step that produced it (the prefill for step 0);
    finish : None, or why this sequence stopped after this token: "eos" | "stop" | "length".
    """

    seq: int
    step: int
    token_id: int
    text: str
    step_s: float
    finish: str | None = None


@dataclass
class GenerationStats:
    """Timings of the last generation: prefill seconds, per-step decode seconds (one per batch step)."""

    prompt_tokens: list = field(default_factory=list)
    prefill_s: float = 0.0
    decode_steps_s: list = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        """Decode steps per second: tokens/s of each sequence (times the batch for all sequences)."""
        return len(self.decode_steps_s) / max(sum(self.decode_steps_s), 1e-12)


class Generator:
    """Streams completions from a :class:`Transformer` on fresh caches per call.

    Parameters
    ----------
    model : Transformer
    tokenizer : Tokenizer
    cache : {"full", "window", "sinks"}
    window, sinks : int, optional
        Window n_c (keys incl. the current one) and sink count for "window"/"sinks".
    backend : str
        Attention backend ("reference" | "cpu" | "gpu" | "auto").
    prefill_chunk : int
        Prompt tokens per forward call during prefill (and the caches' ``max_chunk``).
    cache_dtype : {"float32", "float16", "bfloat16"}
    positions : {"absolute", "cache"}
        RoPE positions: in the text, or within the cache (StreamingLLM; matters for "sinks" only).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, cache: str = "full",
                 window: int | None = None, sinks: int = 0, backend: str = "cpu", prefill_chunk: int = 64,
                 cache_dtype: str = "float32", positions: str = "absolute"):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (got {prefill_chunk})")
        from streamattn.models.transformer import POSITIONS
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS} (got {positions!r})")
        self.model, self.tok = model, tokenizer
        self.positions = positions
        self.cache_kw = dict(mode=cache, window=window, sinks=sinks, dtype=cache_dtype, max_chunk=prefill_chunk)
        model.new_caches(batch=1, **self.cache_kw)          # validate the cache settings now
        self.backend = backend
        self.prefill_chunk = prefill_chunk
        self.stats = GenerationStats()
        self.caches = None

    def encode_prompt(self, prompt, *, chat: bool = False, system: str | None = None) -> list:
        """Token ids of a prompt (str, or list of ids); ``chat`` wraps it in the chat template."""
        if not isinstance(prompt, str):
            ids = [int(i) for i in prompt]
            if not ids:
                raise ValueError("prompt is an empty list of token ids")
            return ids
        if chat:
            msgs = [{"role": "system", "content": system}] if system else []
            msgs.append({"role": "user", "content": prompt})
            prompt = self.tok.apply_chat(msgs)
        ids = self.tok.encode(prompt)
        if not ids:
            raise ValueError("prompt encodes to no tokens; give some text")
        return ids

    def prefill(self, prompts: list, *, progress: Callable[[int, int], None] | None = None):
        """Fresh caches, then feed each prompt (lists of ids) in chunks; returns last logits [B, vocab]."""
        B = len(prompts)
        self.caches = self.model.new_caches(batch=B, **self.cache_kw)
        lens = np.array([len(p) for p in prompts], np.int64)
        done = np.zeros(B, np.int64)
        last = [None] * B
        C = self.prefill_chunk
        while (done < lens).any():
            cnt = np.minimum(lens - done, C)                                        # [B] ragged chunk
            T = int(cnt.max())
            toks = np.zeros((B, T), np.int64)
            for b in range(B):
                toks[b, :cnt[b]] = prompts[b][done[b]: done[b] + cnt[b]]
            logits = self.model.forward(toks, self.caches, counts=cnt, backend=self.backend, last_only=True,
                                        positions=self.positions)
            logits = to_host(logits, copy=False)
            done += cnt
            for b in np.nonzero((cnt > 0) & (done == lens))[0]:
                last[b] = logits[b]
            if progress is not None:
                progress(int(done.sum()), int(lens.sum()))
        return np.stack(last)

    def stream(self, prompt, *, max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
               stop: tuple = (), chat: bool = False, progress=None,
               ignore_eos: bool = False) -> Iterator[TokenEvent]:
        """Yield each new token of one prompt. See :meth:`stream_batch` (this is its batch of one)."""
        yield from self.stream_batch([prompt], max_tokens=max_tokens, sampling=sampling, stop=stop, chat=chat,
                                     progress=progress, ignore_eos=ignore_eos)

    def stream_batch(self, prompts: list, *, max_tokens: int = 128,
                     sampling: SamplingParams = SamplingParams(), stop: tuple = (), chat: bool = False,
                     progress=None, ignore_eos: bool = False) -> Iterator[TokenEvent]:
        """Decode several prompts together as one ragged batch, yielding tokens as they come.

        Parameters
        ----------
        prompts : list of (str or list of int)
        max_tokens : int
            New tokens per prompt at most.
        sampling : SamplingParams
            One seeded numpy Generator serves the whole batch (draws in sequence order).
        stop : tuple of str
            Stop when the completion's text contains one of these (the text up to it is still yielded
            as pieces; the piece that completes a stop string is cut before it).
        chat : bool
            Wrap string prompts in the model's chat template.
        progress : callable(done_tokens, total_tokens), optional
            Prefill progress.
        ignore_eos : bool
            Keep going past end-of-sequence tokens (benchmarks: a fixed number of tokens).

        Yields
        ------
        TokenEvent
            In step order; within a step, in sequence order. Finished sequences stop yielding.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
        if isinstance(stop, str):
            stop = (stop,)
        ids = [self.encode_prompt(p, chat=chat) for p in prompts]
        B = len(ids)
        rng = np.random.default_rng(sampling.seed)
        decoders = [StreamDecoder(self.tok) for _ in range(B)]
        texts = [""] * B
        seen = [list(p) for p in ids]
        active = np.ones(B, bool)
        self.stats = GenerationStats(prompt_tokens=[len(p) for p in ids])
        t0 = time.perf_counter()
        logits = self.prefill(ids, progress=progress)
        self.stats.prefill_s = step_s = time.perf_counter() - t0
        for step in range(max_tokens):
            t0 = time.perf_counter()
            nxt = np.zeros(B, np.int64)
            events = []
            for b in np.nonzero(active)[0]:
                tid = sample(logits[b], sampling, rng, seen[b])
                nxt[b] = tid
                seen[b].append(tid)
                finish, piece = None, ""
                if tid in self.tok.stop_ids and not ignore_eos:
                    finish, piece = "eos", decoders[b].flush()
                else:
                    piece = decoders[b].push(tid)
                    cut = _stop_cut(texts[b], piece, stop)
                    if cut is not None:
                        finish, piece = "stop", piece[:cut]
                    elif step == max_tokens - 1:
                        finish, piece = "length", piece + decoders[b].flush()
                texts[b] += piece
                events.append((b, tid, piece, finish))
                if finish:
                    active[b] = False
            sample_s = time.perf_counter() - t0
            for b, tid, piece, finish in events:
                yield TokenEvent(seq=int(b), step=step, token_id=int(tid), text=piece, step_s=step_s,
                                 finish=finish)
            if not active.any():
                break
            t0 = time.perf_counter()
            cnt = active.astype(np.int64)                     # finished sequences send padding (count 0)
            logits = to_host(self.model.forward(nxt[:, None], self.caches, counts=None if active.all() else cnt,
                                                backend=self.backend, last_only=True, positions=self.positions),
                             copy=False)
            step_s = time.perf_counter() - t0 + sample_s
            self.stats.decode_steps_s.append(step_s)

    def generate(self, prompt, **kw) -> str:
        """The whole completion of one prompt as a string (see :meth:`stream`)."""
        return "".join(ev.text for ev in self.stream(prompt, **kw))


def _stop_cut(prev: str, piece: str, stop) -> int | None:
    """Index in ``piece`` where the first stop string completed by ``prev + piece`` starts (clipped to 0)."""
    if not stop or not piece:
        return None
    text = prev + piece
    best = None
    for s in stop:
        if not s:
            continue
        i = text.find(s, max(0, len(prev) - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return None if best is None else max(0, best - len(prev))


def warm_model(model, kind: str) -> float:
    """Run ``model`` (a CPU :class:`~streamattn.models.transformer.Transformer`) once on throwaway caches:
    a chunk of :data:`~streamattn.models.qmatmul.ROWS` tokens, one token, then a chunk with a padded row,
    so that every kernel a prefill, a decode step and a ragged batch call (the packed matmul drivers of
    each weight kind, the fused norm and activation quantizers, attention for storage ``kind``) is
    compiled or loaded from Numba's cache now, outside any timing, as llama.cpp's warm-up decode does.
    Seconds taken.

    Loading the matmul drivers of one weight kind took 0.3-1.3 s in a fresh process (docs/PERF.md), which
    a timed prefill had counted. LLVM's library pages, which only loading needs, are handed back before
    and after each of the two kinds of loading (:func:`streamattn.memory.release_compiler_pages`): the
    compiled layers, then the array layers' kernels, so that their pages never add up (peak RSS of
    ``streamattn generate`` on SmolLM2, 705-token prompt: 294 -> 273 MB)."""
    from streamattn.memory import release_compiler_pages
    from streamattn.quant.matmul import ROWS
    t0 = time.perf_counter()
    release_compiler_pages()          # those touched by what loaded before (the CLI's attention warm-up)
    caches = model.new_caches(batch=1, max_chunk=ROWS, dtype=kind)
    model.forward(np.zeros((1, ROWS), np.int64), caches, last_only=True)
    model.forward(np.zeros((1, 1), np.int64), caches, last_only=True)
    release_compiler_pages()          # the compiled layers are loaded: LLVM's pages can go (memory.py), so
    # that they do not add to those the array layers' kernels touch next: a padded row goes through those,
    # as ragged batches do (dispatch._append_attend; servers take them)
    model.forward(np.zeros((1, 2), np.int64), caches, counts=np.array([1]), last_only=True)
    release_compiler_pages()
    return time.perf_counter() - t0
