"""``streamattn batch``: offline generation of a JSON-lines file, in this process or on Ray (``--ray``).

    streamattn batch prompts.jsonl -o out.jsonl [--model M] [-n 64] [--temperature T] [--batch-size 8]
    streamattn batch prompts.jsonl -o out.jsonl --ray --actors 2 --cpus-per-actor 1

File formats: :mod:`streamattn.scale.jobs`. Lines are decoded as ragged batches of up to ``--batch-size``
prompts (``Generator.stream_batch``). Lines share a batch only when they share their sampling settings,
and a seeded line that samples (temperature > 0) runs alone, because a batch draws from one seeded stream:
so a line's text does not depend on which other lines share its batch, and the local and Ray runs agree.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from streamattn.models.sampling import SamplingParams
from streamattn.scale.jobs import BadLine, OutputFile, Progress, Request, read_requests


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
    prefill_chunk: int = 64
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
        from streamattn.models.hub import resolve_model
        from streamattn.models.loader import load_gguf
        from streamattn.models.tokenizer import Tokenizer
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


# ---------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSON lines: {id, prompt | messages, optional sampling overrides}")
    p.add_argument("-o", "--output", required=True, help="JSON-lines output; ids already in it are skipped")
    p.add_argument("--model", default=None,
                   help="a .gguf path or a model name (smollm2-135m, gemma3-270m); default smollm2-135m")
    p.add_argument("--cache", choices=("full", "window", "sinks"), default="full")
    p.add_argument("--window", type=int, default=None, help="window n_c for --cache window|sinks (default 256)")
    p.add_argument("--sinks", type=int, default=4, help="attention-sink tokens for --cache sinks")
    p.add_argument("--backend", default="cpu", help="attention backend: reference|cpu|gpu|auto")
    p.add_argument("--cache-dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per forward call")
    p.add_argument("--chat", action="store_true", help="wrap 'prompt' lines in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker (per actor with --ray)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="default max_tokens of a line")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="default temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="default stop string (repeatable)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (per actor with --ray)")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="a bad line stops the run before any decoding (stop) or is reported and skipped (skip)")
    p.add_argument("--ray", action="store_true", help="run on Ray Data: one model per actor")
    p.add_argument("--actors", type=int, default=2, help="Ray actors (each loads the model once)")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs Ray reserves per actor")
    p.add_argument("--ray-address", default=None,
                   help="cluster to join ('auto', or host:port of the head); default: RAY_ADDRESS, else a "
                        "local Ray started for this run and stopped after it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run_args(args) -> int:
    for name, v, lo in (("--batch-size", args.batch_size, 1), ("--actors", args.actors, 1),
                        ("--max-tokens", args.max_tokens, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo} (got {v})")
    if args.cpus_per_actor <= 0:
        raise ValueError(f"--cpus-per-actor must be > 0 (got {args.cpus_per_actor})")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repeat_penalty, seed=args.seed)
    opts = ModelOptions(model=args.model, cache=args.cache, window=args.window, sinks=args.sinks,
                        backend=args.backend, cache_dtype=args.cache_dtype, prefill_chunk=args.prefill_chunk,
                        threads=args.threads, chat=args.chat, system=args.system)
    with OutputFile(args.output) as out:
        got = read_requests(args.input, done=out.done, max_tokens=args.max_tokens, sampling=sampling,
                            stop=tuple(args.stop))
        for e in got.bad:
            print(f"streamattn batch: {args.input}: {e}", file=sys.stderr)
        if got.bad and args.on_error == "stop":
            raise ValueError(f"{len(got.bad)} bad line(s) in {args.input} (first: {got.bad[0]}); fix them or "
                             f"pass --on-error skip")
        if not args.quiet:
            print(f"streamattn batch: {len(got.requests)} to run, {got.already_done} already in {args.output}"
                  + (f", {len(got.bad)} bad line(s) skipped" if got.bad else ""), file=sys.stderr)
        progress = Progress(len(got.requests), quiet=args.quiet)
        if args.ray:
            from streamattn.scale.ray_batch import run_ray
            errors = run_ray(got.requests, out, opts, actors=args.actors, cpus_per_actor=args.cpus_per_actor,
                             batch_size=args.batch_size, progress=progress, address=args.ray_address,
                             stop_on_error=args.on_error == "stop")
        else:
            errors = run_local(got.requests, out, opts, batch_size=args.batch_size, progress=progress,
                               stop_on_error=args.on_error == "stop")
    for e in errors:
        print(f"streamattn batch: {args.input}: {e}", file=sys.stderr)
    if errors and args.on_error == "stop":
        raise ValueError(f"{len(errors)} line(s) failed (first: {errors[0]}); rerun the same command to resume")
    if not args.quiet:
        print(f"streamattn batch: {progress.line()}; wrote {args.output}", file=sys.stderr)
    return 1 if (got.bad or errors) else 0


__all__ = ["ModelOptions", "complete", "run_local", "add_arguments", "run_args"]
