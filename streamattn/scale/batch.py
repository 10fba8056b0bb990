"""Offline generation of a list of requests in this process: ``ModelOptions``, ``complete``, ``run_local``.

The ``streamattn batch`` command (streamattn/scale/command.py) runs these, or their Ray Data twin
(streamattn/scale/ray_batch.py) with ``--ray``:

    streamattn batch prompts.jsonl -o out.jsonl [--model M] [-n 64] [--temperature T] [--batch-size 8]
    streamattn batch prompts.jsonl -o out.jsonl --ray --actors 2 --cpus-per-actor 1

File formats: :mod:`streamattn.scale.jobs`. Lines are decoded as ragged batches of up to ``--batch-size``
prompts through the engine (``Generator.stream_jobs``), each line with its own settings and seed, so a
line's text does not depend on which other lines share its batch, and the local and Ray runs agree.
"""

from __future__ import annotations

import json

from streamattn.engine.options import ModelOptions
from streamattn.scale.jobs import BadLine, OutputFile, Progress, Request


def load_generator(opts: ModelOptions):
    """Load the model of ``opts`` once: the Generator a worker decodes with."""
    tf, tok, _ = opts.load()
    from streamattn.engine.generate import Generator
    return Generator(tf, tok, opts.engine_config())


def complete(gen, requests: list, opts: ModelOptions) -> list:
    """Decode a list of requests as one ragged batch, each with its own settings and seed; one result
    dict per request, in the input order.

    Each result is ``{"line", "record"}`` with the output record, or ``{"line", "id", "error"}`` when the
    request could not run (e.g. its chat messages do not fit the template) or its grammar could not go on
    while decoding (a one-line message); the other requests still run.
    A record's text depends on its own line only, never on which lines share its batch.
    """
    from streamattn.engine.grammar import response_format_grammar
    from streamattn.engine.sequence import Job
    results: dict = {}
    runs = []
    for r in requests:
        try:
            if r.messages is not None:
                ids = gen.tok.encode(gen.tok.apply_chat([dict(m) for m in r.messages]))
            else:
                ids = gen.encode_prompt(r.prompt, chat=opts.chat, system=opts.system)
            grammar = (None if r.response_format is None
                       else response_format_grammar(json.loads(r.response_format), gen.grammars))
            job = Job(prompt=tuple(ids), max_tokens=r.max_tokens, sampling=r.sampling, stop=r.stop,
                      cache_prompt=False, speculative=opts.spec_params, grammar=grammar)
        except Exception as e:                      # noqa: BLE001 - reported per line, the batch goes on
            results[r.line] = {"line": r.line, "id": r.id, "error": f"{type(e).__name__}: {e}"}
            continue
        runs.append((r, job))
    texts = [[] for _ in runs]
    last = [None] * len(runs)
    for ev in (gen.stream_jobs([job for _, job in runs]) if runs else ()):   # every line failed: none
        texts[ev.seq].append(ev.text)
        last[ev.seq] = ev
    for (r, job), t, ev in zip(runs, texts, last):
        if ev.error is not None:                    # this line's grammar could not go on: its error record
            results[r.line] = {"line": r.line, "id": r.id, "error": ev.error}
            continue
        results[r.line] = {"line": r.line, "record": {
            "id": r.id, "text": "".join(t), "prompt_tokens": len(job.prompt), "completion_tokens": ev.step + 1,
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
    gen = load_generator(opts)
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


__all__ = ["ModelOptions", "complete", "load_generator", "run_local"]
