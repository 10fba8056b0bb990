"""Token-by-token generation in Python: :class:`Generator` streams completions through the one
:class:`~streamattn.engine.core.Engine` (chunked prefill, per-sequence sampling, the stop rule, ragged
batches) and times each step.

>>> gen = Generator(Transformer(m), Tokenizer.from_metadata(m.metadata))          # doctest: +SKIP
>>> for ev in gen.stream("The capital of France is", max_tokens=8):
...     print(ev.text, end="", flush=True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from streamattn.engine.core import Engine
from streamattn.engine.options import EngineConfig
from streamattn.engine.sampling import SamplingParams
from streamattn.engine.grammar import Grammars
from streamattn.engine.sequence import Job, Sequence, check_logit_bias
from streamattn.engine.speculative import SpecParams
from streamattn.models.transformer import Transformer
from streamattn.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenEvent:
    """One generated token.

    seq : index of the prompt in the batch; step : 0-based index of the token in its completion;
    token_id / text : the token and the text it releases (may be '' while it could still begin a stop
    string, or mid-character; the held text comes with a later token or the last one);
    step_s : wall seconds of the engine step that produced it (the whole prefill for step 0);
    finish : None, or why this sequence stopped after this token: "stop" (end of sequence or a stop
    string) | "length" (``max_tokens``) | "error": then the event carries no token (``token_id`` -1,
    ``step`` = the tokens generated before it) and ``error`` says, in one line, why this sequence alone
    ended (its grammar could not go on); the other sequences of the batch go on.
    """

    seq: int
    step: int
    token_id: int
    text: str
    step_s: float
    finish: str | None = None
    error: str | None = None


@dataclass
class GenerationStats:
    """Timings of the last generation: prefill seconds, per-step decode seconds (one per batch step) and
    the threads each decode step ran on."""

    prompt_tokens: list = field(default_factory=list)
    prefill_s: float = 0.0
    decode_steps_s: list = field(default_factory=list)
    decode_tokens: int = 0                       # tokens all sequences gained in decode steps
    decode_threads: list = field(default_factory=list)   # threads each decode step ran on (the chooser's pick)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of each sequence in the decode steps (times the batch for all sequences):
        one a step, more with speculation."""
        per_seq = self.decode_tokens / max(len(self.prompt_tokens), 1)
        return per_seq / max(sum(self.decode_steps_s), 1e-12)


class Generator:
    """Streams completions from a :class:`Transformer` on fresh caches per call.

    Parameters
    ----------
    model : Transformer
    tokenizer : Tokenizer
    config : EngineConfig, optional
        The cache, backend, chunking and position settings (:class:`~streamattn.engine.options.EngineConfig`
        and its defaults); ``slots`` is set per call.
    **settings
        EngineConfig fields that replace ``config``'s (``cache="sinks", window=64``, ``prefill_chunk=16``).

    After a call, ``caches`` holds every sequence's K/V (one KVCache per layer, batch = prompts) and
    ``stats`` its timings.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None, **settings):
        self.model, self.tok = model, tokenizer
        self._step_costs: dict = {}                    # thread count -> StepCosts, kept across generations
        self.config = replace(config if config is not None else EngineConfig(), **settings)
        model.new_caches(batch=1, **self.config.cache_kwargs)          # validate the cache settings now
        self.stats = GenerationStats()
        self.caches = None
        self._grammars = None

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler and cache of this generator's tokenizer."""
        if self._grammars is None:
            self._grammars = Grammars(self.tok)
        return self._grammars

    @property
    def backend(self) -> str:
        return self.config.backend

    @property
    def positions(self) -> str:
        return self.config.positions

    @property
    def prefill_chunk(self) -> int:
        return self.config.prefill_chunk

    @property
    def cache_kw(self) -> dict:
        """Keyword arguments of ``Transformer.new_caches`` for this generator's caches (without ``batch``)."""
        return self.config.cache_kwargs

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
        seqs: list = []
        for _ in self.stream_jobs([Job(prompt=tuple(p), max_tokens=0) for p in prompts], progress=progress,
                                  seqs=seqs):
            pass
        return np.stack([s.last_logits for s in seqs])

    def stream(self, prompt, *, max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
               stop: tuple = (), chat: bool = False, progress=None, ignore_eos: bool = False,
               speculative: SpecParams | None = None, grammar=None, logit_bias: dict | None = None
               ) -> Iterator[TokenEvent]:
        """Yield each new token of one prompt. See :meth:`stream_batch` (this is its batch of one)."""
        yield from self.stream_batch([prompt], max_tokens=max_tokens, sampling=sampling, stop=stop, chat=chat,
                                     progress=progress, ignore_eos=ignore_eos, speculative=speculative,
                                     grammar=grammar, logit_bias=logit_bias)

    def stream_batch(self, prompts: list, *, max_tokens: int = 128,
                     sampling: SamplingParams | list = SamplingParams(), stop: tuple = (), chat: bool = False,
                     progress=None, ignore_eos: bool = False, speculative: SpecParams | None = None,
                     grammar=None, logit_bias: dict | None = None) -> Iterator[TokenEvent]:
        """Decode several prompts together as one ragged batch, yielding tokens as they come.

        Parameters
        ----------
        prompts : list of (str or list of int)
        max_tokens : int
            New tokens per prompt at most.
        sampling : SamplingParams, or one per prompt
            Each sequence samples from its own generator seeded with its ``seed``: a seeded completion
            is the same alone and in any batch.
        stop : tuple of str
            Stop when the completion's text contains one of these. Neither the stop string nor any text
            that might still begin one is ever yielded (it is held back until it cannot).
        chat : bool
            Wrap string prompts in the model's chat template.
        progress : callable(done_tokens, total_tokens), optional
            Prefill progress.
        ignore_eos : bool
            Keep going past end-of-sequence tokens (benchmarks: a fixed number of tokens).
        speculative : SpecParams, optional
            Draft tokens by prompt lookup and verify them in one step each
            (:mod:`streamattn.engine.speculative`): greedy tokens are exactly those without it; each
            sequence drafts on its own. ``draft_max`` is capped at ``prefill_chunk - 1``.
        grammar : Grammar, a JSON schema (dict), or one per prompt (None: unconstrained)
            Enforced on every token (:mod:`streamattn.engine.grammar`; a dict is compiled once by
            :attr:`grammars`); the sequence finishes "stop" when the grammar completes.
        logit_bias : dict token id -> float, optional
            Added to those tokens' logits before anything else (OpenAI's ``logit_bias``).

        Yields
        ------
        TokenEvent
            In step order; within a step, in sequence order. Finished sequences stop yielding.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (got {max_tokens!r})")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        ids = [self.encode_prompt(p, chat=chat) for p in prompts]
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"sampling holds {len(params)} SamplingParams for {len(ids)} prompts")
        grammars = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * len(ids)
        if len(grammars) != len(ids):
            raise ValueError(f"grammar holds {len(grammars)} entries for {len(ids)} prompts")
        bias = check_logit_bias(logit_bias, self.tok.vocab_size)
        jobs = [Job(prompt=tuple(p), max_tokens=max_tokens, sampling=sp, stop=stop, ignore_eos=ignore_eos,
                    cache_prompt=False, speculative=speculative, logit_bias=bias,
                    grammar=self.grammars.json_schema(g) if isinstance(g, dict) else g)
                for p, sp, g in zip(ids, params, grammars)]
        yield from self.stream_jobs(jobs, progress=progress)

    def stream_jobs(self, jobs: list, *, progress=None, seqs: list | None = None) -> Iterator[TokenEvent]:
        """Decode :class:`~streamattn.engine.sequence.Job` objects (each with its own prompt ids,
        ``max_tokens``, sampling, stop strings) as one ragged batch on fresh caches; yield each new token
        as :meth:`stream_batch` does. ``seqs``, if given, receives the jobs' :class:`Sequence` objects."""
        B = len(jobs)
        from streamattn.engine.speculative import StepCosts
        from streamattn.runtime.threads import thread_count
        costs = self._step_costs.setdefault(thread_count(), StepCosts())     # step times at this thread count
        engine = Engine(self.model, self.tok, replace(self.config, slots=B), isolate_failures=False,
                        reset_finished=False, step_costs=costs)
        self.caches = engine.caches
        texts = [{} for _ in range(B)]                                  # token index -> text it released
        done = [None] * B                                               # finish reason, once finished
        errors = [None] * B                                             # a failed sequence's message
        mine: list = []
        for b, j in enumerate(jobs):
            mine.append(Sequence(job=j, emit=self._collect(texts[b], done, errors, mine, b), tok=self.tok))
        if seqs is not None:
            seqs.extend(mine)
        seqs = mine
        for s in seqs:
            engine.submit(s)
        self.stats = stats = GenerationStats(prompt_tokens=[len(j.prompt) for j in jobs])
        total, made, prefill = sum(stats.prompt_tokens), [0] * B, True
        while engine.busy:
            t0 = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - t0
            if prefill:
                stats.prefill_s += step_s
                if progress is not None:
                    progress(sum(s.done for s in seqs), total)
                prefill = any(s.prefilling for s in seqs)
                step_s = stats.prefill_s
            else:
                stats.decode_steps_s.append(step_s)
                stats.decode_threads.append(engine.step_threads)
                stats.decode_tokens += sum(len(s.generated) for s in seqs) - sum(made)
            for b, s in enumerate(seqs):
                n = len(s.generated)
                last = done[b] if errors[b] is None else None
                for i in range(made[b], n):                             # several with speculation
                    yield TokenEvent(seq=b, step=i, token_id=int(s.generated[i]), text=texts[b].pop(i, ""),
                                     step_s=step_s, finish=last if i == n - 1 else None)
                made[b] = n
                if errors[b] is not None:
                    yield TokenEvent(seq=b, step=n, token_id=-1, text="", step_s=step_s, finish="error",
                                     error=errors[b])
                    errors[b] = None                                    # said once

    @staticmethod
    def _collect(texts: dict, done: list, errors: list, seqs: list, b: int):
        """The emit callback of ``seqs[b]``: the text each of its tokens released, its finish reason, and
        the message of a sequence that failed (the engine raises everything else itself)."""
        def emit(ev):
            if ev.kind == "delta":
                i = len(seqs[b].generated) - 1
                texts[i] = texts.get(i, "") + ev.text
            else:
                done[b] = ev.finish if ev.kind == "done" else "error"
                if ev.kind == "error":
                    errors[b] = ev.message
        return emit

    def generate(self, prompt, **kw) -> str:
        """The whole completion of one prompt as a string (see :meth:`stream`); GrammarError (one line)
        if its grammar could not go on."""
        from streamattn.engine.grammar import GrammarError
        out = []
        for ev in self.stream(prompt, **kw):
            if ev.error is not None:
                raise GrammarError(ev.error)
            out.append(ev.text)
        return "".join(out)


def warm_model(model, kind: str, kind_v: str | None = None, *, array_layers: bool = True) -> float:
    """Run ``model`` (a CPU :class:`~streamattn.models.transformer.Transformer`) once on throwaway caches:
    a chunk of ``model.plan.rows`` tokens (its kernel plan), one token, then a chunk with a padded row
    through the array layers, so that every kernel a prefill, a decode step and the array layers call
    (the packed matmul drivers of each weight kind, the fused norm and activation quantizers, attention
    for storage ``kind``) is compiled or loaded from Numba's cache now, outside any timing, as
    llama.cpp's warm-up decode does. With more than one Numba thread set, the one-token and padded
    calls run on one thread too: the engine's :class:`~streamattn.runtime.threads.ThreadChooser` runs decode
    steps there, whose serial drivers were otherwise loaded by the first such step (~60 ms, 4% of a
    128-token SmolLM2 run). ``array_layers=False`` leaves out the padded call, for a run that never takes
    the array layers (no sinks cache, no hook: :meth:`~streamattn.models.transformer.Transformer.run`
    compiles the rest): each of its passes reads every weight once more. Seconds taken.

    LLVM's library pages, which only loading needs, are handed back before and after each of the two
    kinds of loading (:func:`streamattn.runtime.memory.release_compiler_pages`): the compiled layers, then the
    array layers' kernels, so that their pages never add up (docs/DESIGN.md §11; the figures:
    docs/PERF.md)."""
    from streamattn.runtime.memory import release_compiler_pages
    t0 = time.perf_counter()
    release_compiler_pages()          # those touched by what loaded before (the CLI's attention warm-up)
    rows = model.plan.rows
    caches = model.new_caches(batch=1, max_chunk=rows, dtype=kind, dtype_v=kind_v)
    model.forward(np.zeros((1, rows), np.int64), caches, last_only=True)
    _on_each_count(lambda: model.forward(np.zeros((1, 1), np.int64), caches, last_only=True))
    release_compiler_pages()          # the compiled layers are loaded: LLVM's pages can go (memory.py), so
    # that they do not add to those the array layers' kernels touch next: a padded row through the array
    # layers (a hook keeps a call there), as sinks at cache positions and hooks run (dispatch._append_attend)
    if array_layers:
        _on_each_count(lambda: model.forward(np.zeros((1, 2), np.int64), caches, counts=np.array([1]),
                                             last_only=True, attn_hook=lambda *a: None))
        release_compiler_pages()
    return time.perf_counter() - t0


def _on_each_count(call) -> None:
    """``call()`` on the Numba thread count set, then, where it is above 1, on one thread under the same
    ceiling, as a ThreadChooser's step runs (:func:`streamattn.runtime.threads.threads`: the counts put back after,
    also when it raises)."""
    import numba
    from streamattn.runtime.threads import threads
    call()
    if numba.get_num_threads() > 1:
        with threads(1, step_down=True):
            call()
