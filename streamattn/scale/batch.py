"""Offline generation of a list of requests in this process: ``ModelOptions``, ``complete``, ``run_local``.

The ``streamattn batch`` command (streamattn/scale/command.py) runs these, or their Ray Data twin
(streamattn/scale/ray_batch.py) with ``--ray``:

    streamattn batch prompts.jsonl -o out.jsonl [--model M] [-n 64] [--temperature T] [--batch-size 8]
    streamattn batch prompts.jsonl -o out.jsonl --ray --actors 2 --cpus-per-actor 1

File formats: :mod:`streamattn.scale.jobs`. Lines are decoded as ragged batches of up to ``--batch-size``
prompts (``Generator.stream_batch``). Lines share a batch only when they share their sampling settings,
and a seeded line that samples (temperature > 0) runs alone, because a batch draws from one seeded stream:
so a line's text does not depend on which other lines share its batch, and the local and Ray runs agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamattn.scale.jobs import BadLine, OutputFile, Progress, Request


@dataclass(frozen=True)
class ModelOptions:
    """How a worker builds its :class:`~streamattn.models.generate.Generator` (plain values: they travel
    to Ray actors). Fields as the ``streamattn generate`` flags of the same names."""

    model: str | None = None
    cache: str = "full"
    window: int | None = None
    sinks: int = 4
    backend: str = "cpu"
    cache_dtype: str = "float32"
    prefill_chunk: int = 256
    threads: int = 1
    chat: bool = False
    system: str | None = None

    def __post_init__(self):
        if self.cache not in ("full", "window", "sinks"):
            raise ValueError(f"cache must be one of full|window|sinks (got {self.cache!r})")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1 (got {self.threads})")

    def load(self):
        """Load the model once: the Generator this worker decodes with."""
        from streamattn.models.generate import Generator
        from streamattn.gguf.hub import resolve_model
        from streamattn.gguf.loader import load_gguf
        from streamattn.text.tokenizer import Tokenizer
        from streamattn.models.transformer import Transformer
        from streamattn.threads import set_threads

        set_threads(self.threads)
        m = load_gguf(resolve_model(self.model, quiet=True))
        tf = Transformer(m)
        if self.backend == "gpu":
            import cupy
            tf.to(cupy)
        window = self.window if self.window is not None or self.cache == "full" else 256
        return Generator(tf, Tokenizer.from_metadata(m.metadata), cache=self.cache, window=window,
                         sinks=self.sinks if self.cache == "sinks" else 0, backend=self.backend,
                         prefill_chunk=self.prefill_chunk, cache_dtype=self.cache_dtype)


def _group_key(r: Request):
    alone = r.sampling.temperature > 0 and r.sampling.seed is not None
    return (r.sampling, r.max_tokens, r.stop, r.line if alone else None)


def complete(gen, requests: list, opts: ModelOptions) -> list:
    """Decode a list of requests; one result dict per request, in the input order.

    Each result is ``{"line", "record"}`` with the output record, or ``{"line", "id", "error"}`` when the
    request could not run (e.g. its chat messages do not fit the template); the other requests still run.
    """
    results: dict = {}
    groups: dict = {}
    for r in requests:
        try:
            if r.messages is not None:
                ids = gen.tok.encode(gen.tok.apply_chat([dict(m) for m in r.messages]))
            else:
                ids = gen.encode_prompt(r.prompt, chat=opts.chat, system=opts.system)
        except Exception as e:                      # noqa: BLE001 - reported per line, the batch goes on
            results[r.line] = {"line": r.line, "id": r.id, "error": f"{type(e).__name__}: {e}"}
            continue
        groups.setdefault(_group_key(r), []).append((r, ids))
    for members in groups.values():
        r0 = members[0][0]
        texts = [[] for _ in members]
        last = [None] * len(members)
        for ev in gen.stream_batch([ids for _, ids in members], max_tokens=r0.max_tokens, sampling=r0.sampling,
                                   stop=r0.stop):
            texts[ev.seq].append(ev.text)
            last[ev.seq] = ev
        for (r, ids), t, ev in zip(members, texts, last):
            results[r.line] = {"line": r.line, "record": {
                "id": r.id, "text": "".join(t), "prompt_tokens": len(ids), "completion_tokens": ev.step + 1,
                "finish_reason": ev.finish}}
    return [results[r.line] for r in requests]


def run_local(requests: list, out: OutputFile, opts: ModelOptions, *, batch_size: int = 8,
              progress: Progress | None = None, stop_on_error: bool = False, on_result=None) -> list:
    """Decode ``requests`` in this process, ``batch_size`` at a time, writing each batch's records as it
    ends.

    Returns the failed requests as :class:`BadLine` errors (see :func:`complete`); with ``stop_on_error``
    the run stops after the batch holding the first one. ``on_result(result)`` sees every result.
    """
    if not requests:
        return []
    gen = opts.load()
    if progress is not None:
        progress.start()
    errors = []
    for i in range(0, len(requests), batch_size):
        for res in complete(gen, requests[i:i + batch_size], opts):
            _take(res, out, progress, errors, on_result)
        if errors and stop_on_error:
            break
    return errors


def _take(res: dict, out: OutputFile, progress, errors: list, on_result) -> None:
    """Write one result's record, or keep its error."""
    if on_result is not None:
        on_result(res)
    if "error" in res:
        errors.append(BadLine(res["line"], f"id {res['id']!r}: {res['error']}"))
    elif out.write(res["record"]) and progress is not None:
        progress.update(res["record"]["completion_tokens"])


__all__ = ["ModelOptions", "complete", "run_local"]
