"""``streamattn batch``: the command line over the local runner (batch.py) and the Ray runner (ray_batch.py).

Its own module so that batch.py and ray_batch.py import in one direction only (ray_batch builds on batch).
"""

from __future__ import annotations

import argparse
import json
import sys

from streamattn.engine.options import ModelOptions, add_arguments as add_model_arguments
from streamattn.engine.sampling import SamplingParams, add_arguments as add_sampling_arguments
from streamattn.runtime.files import check_regular, open_regular, same_file
from streamattn.scale.batch import run_local
from streamattn.scale.jobs import MAX_STOP, MAX_STOP_CHARS, OutputFile, Progress, read_requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSON lines: {id, prompt | messages, optional sampling overrides}")
    p.add_argument("-o", "--output", required=True, help="JSON-lines output; ids already in it are skipped")
    add_model_arguments(p)                         # the flags every subcommand shares
    from streamattn.engine.speculative import add_arguments as add_speculative_arguments
    add_speculative_arguments(p)
    add_sampling_arguments(p)                      # each line may override them (streamattn.scale.jobs)
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


def prompt_measure(opts: ModelOptions):
    """A ``measure`` for :func:`~streamattn.scale.jobs.read_requests`: each line's prompt is encoded (chat
    template included) with the model's tokenizer, read from the file's metadata without its weights, and
    must leave one token of the model's context to generate. The encoding stops early (bounded by the
    context, not by the line) for a prompt too long to fit."""
    from streamattn.engine.grammar import Grammars, response_format_grammar
    from streamattn.gguf.hub import resolve_model
    from streamattn.gguf.loader import load_header
    from streamattn.text.tokenizer import Tokenizer

    md, config = load_header(resolve_model(opts.model, quiet=True))
    tok, context = Tokenizer.from_metadata(md), int(config.context_length)
    grammars = Grammars(tok)

    def measure(r) -> int:
        if r.response_format is not None:      # compiled and probed now, before any line decodes
            response_format_grammar(json.loads(r.response_format), grammars)
        if r.messages is not None:
            text = tok.apply_chat([dict(m) for m in r.messages])
        elif opts.chat:
            msgs = [{"role": "system", "content": opts.system}] if opts.system else []
            text = tok.apply_chat(msgs + [{"role": "user", "content": r.prompt}])
        else:
            text = r.prompt
        try:
            n = len(tok.encode(text, max_tokens=context - 1))
        except ValueError as e:
            raise ValueError(f"the prompt is too long for the model's context of {context} tokens ({e}); "
                             "shorten it") from None
        if n == 0:
            raise ValueError("the prompt encodes to no tokens; give some text")
        return n
    return measure


def run_args(args) -> int:
    for name, v, lo in (("--batch-size", args.batch_size, 1), ("--actors", args.actors, 1),
                        ("--max-tokens", args.max_tokens, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo} (got {v})")
    if len(args.stop) > MAX_STOP or any(not 0 < len(x) <= MAX_STOP_CHARS for x in args.stop):
        raise ValueError(f"--stop: at most {MAX_STOP} stop strings of 1..{MAX_STOP_CHARS} characters each "
                         f"(got {len(args.stop)})")
    if args.cpus_per_actor <= 0:
        raise ValueError(f"--cpus-per-actor must be > 0 (got {args.cpus_per_actor})")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repeat_penalty, seed=args.seed)
    opts = ModelOptions.from_args(args)
    open_regular(args.input).close()              # a FIFO, a device, a folder: refused by name, first
    check_regular(args.output, what="output file")
    if same_file(args.input, args.output):
        raise ValueError(f"-o {args.output} is the input file {args.input}; give another output file")
    measure = prompt_measure(opts)
    with OutputFile(args.output) as out:
        got = read_requests(args.input, done=out.done, done_lines=out.done_lines, measure=measure,
                            max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop))
        for e in got.bad:
            print(f"streamattn batch: {args.input}: {e}", file=sys.stderr)
            if args.on_error == "skip":
                out.write_error(e.line, e.id, str(e))
        if got.bad and args.on_error == "stop":
            raise ValueError(f"{len(got.bad)} bad line(s) in {args.input} (first: {got.bad[0]}); fix them or "
                             f"pass --on-error skip")
        if not args.quiet:
            print(f"streamattn batch: {len(got.requests)} to run, {got.already_done} already in {args.output}"
                  + (f", {len(got.bad)} bad line(s) skipped" if got.bad else ""), file=sys.stderr)
        progress = Progress(len(got.requests), quiet=args.quiet)
        if args.ray:
            from streamattn.scale.ray_batch import run_ray  # only with --ray: imports nothing of Ray until used
            errors = run_ray(got.requests, out, opts, actors=args.actors, cpus_per_actor=args.cpus_per_actor,
                             batch_size=args.batch_size, progress=progress, address=args.ray_address,
                             stop_on_error=args.on_error == "stop")
        else:
            errors = run_local(got.requests, out, opts, batch_size=args.batch_size, progress=progress,
                               stop_on_error=args.on_error == "stop")
        if args.on_error == "skip":
            ids = {r.line: r.id for r in got.requests}
            for e in errors:
                out.write_error(e.line, ids.get(e.line), str(e))
    for e in errors:
        print(f"streamattn batch: {args.input}: {e}", file=sys.stderr)
    if errors and args.on_error == "stop":
        raise ValueError(f"{len(errors)} line(s) failed (first: {errors[0]}); rerun the same command to resume")
    if not args.quiet:
        print(f"streamattn batch: {progress.line()}; wrote {args.output}", file=sys.stderr)
    return 1 if (got.bad or errors) else 0
