"""Teacher-forced perplexity over a long text, streamed in chunks through the model's (ring) caches by
the engine (a :class:`~streamattn.engine.sequence.Job` with ``targets``).

Token t's loss is -log p(ids[t+1] | ids[..t]) from the logits of the forward call that carried t, so a
window or sinks cache answers exactly what a streaming decoder would have seen at that point. Losses are
reported per bucket of ``bucket`` tokens (by the predicting token's position), which is how a
perplexity-versus-position curve shows where a cache starts to hurt (StreamingLLM, Xiao et al. 2023, Fig. 3).

>>> r = perplexity(tf, ids, cache="sinks", window=1020, sinks=4, positions="cache")   # doctest: +SKIP
>>> r["buckets"][0]
{'start': 0, 'end': 1000, 'ppl': 17.2}

Command line: ``streamattn perplexity FILE [--cache ...] [--window N] [--sinks N] [--positions ...]``
writes the JSON of :func:`perplexity` and a PNG of perplexity against position.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from streamattn.engine.core import Engine
from streamattn.engine.options import EngineConfig
from streamattn.engine.sequence import Job, Sequence
from streamattn.runtime.files import check_writable, read_text, same_file
from streamattn.models.transformer import Transformer
from streamattn.kv.spec import CacheSpec


#: Tokens per forward call when scoring: longer than the engine's default chunk, since a text scored alone
#: has no stream waiting behind its chunks.
SCORE_CHUNK = 256


def token_losses(model: Transformer, ids, *, chunk: int = SCORE_CHUNK,
                 progress: Callable[[int, int, float], None] | None = None, **settings) -> np.ndarray:
    """Negative log-likelihood of each next token, teacher-forced through fresh caches.

    Parameters
    ----------
    model : Transformer
    ids : int sequence [n] (n >= 2)
    chunk : int
        Tokens per forward call (also the caches' ``max_chunk``, i.e. the ring's slack).
    **settings
        :class:`~streamattn.engine.options.EngineConfig` fields (``cache``, ``window``, ``sinks``,
        ``positions``, ``backend``, ``cache_dtype``, ``cache_dtype_v``, ``quantized_sinks``, ``rotate_k``),
        with its defaults.
    progress : callable(done, total, nll_sum), optional
        Called after every chunk with the tokens scored so far and the sum of their losses.

    Returns
    -------
    nll : float64 [n - 1], nll[t] = -log p(ids[t+1] | ids[:t+1]) in nats
    """
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or ids.size < 2:
        raise ValueError(f"ids must be a 1-D sequence of at least 2 token ids (got shape {ids.shape})")
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1 (got {chunk!r})")
    n = ids.size - 1                                      # tokens that predict a next one
    config = EngineConfig(prefill_chunk=int(chunk), **settings)
    engine = Engine(model, None, config, isolate_failures=False)
    seq = Sequence(job=Job(prompt=tuple(ids[:-1].tolist()), max_tokens=0, targets=tuple(ids[1:].tolist()),
                           cache_prompt=False), emit=lambda ev: None, tok=None)
    engine.submit(seq)
    while engine.busy:                                    # one chunk of the text a step
        engine.step()
        if progress is not None:
            progress(seq.done, n, float(seq.nll[:seq.done].sum()))
    return seq.nll


def bucket_perplexity(nll, bucket: int = 1000) -> list:
    """[{start, end, ppl}] over consecutive buckets of ``bucket`` token positions (the last may be shorter).

    nll : [n] per-token losses (nats), as :func:`token_losses` returns.
    """
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1 (got {bucket})")
    nll = np.asarray(nll, np.float64)
    return [{"start": s, "end": min(s + bucket, nll.size), "ppl": float(np.exp(nll[s:s + bucket].mean()))}
            for s in range(0, nll.size, bucket)]


def perplexity(model: Transformer, ids, *, bucket: int = 1000, **kw) -> dict:
    """Perplexity of ``ids`` overall and per bucket of positions, with the settings and the speed.

    Parameters
    ----------
    model : Transformer
    ids : int sequence [n]
    bucket : int
        Positions per reported bucket.
    **kw
        cache, window, sinks, positions, chunk, backend, progress, cache_dtype, cache_dtype_v, quantized_sinks,
        rotate_k: see
        :func:`token_losses`.

    Returns
    -------
    dict
        ``tokens`` (n - 1 scored), ``ppl``, ``buckets`` (see :func:`bucket_perplexity`), ``seconds``,
        ``tok_s`` and the settings (``cache``, ``window``, ``sinks``, ``positions``, ``chunk``,
        ``cache_dtype``, ``cache_dtype_v``, ``quantized_sinks``, ``rotate_k`` as the caches resolved it).
    """
    t0 = time.perf_counter()
    nll = token_losses(model, ids, **kw)
    seconds = time.perf_counter() - t0
    cfg = EngineConfig(**{k: v for k, v in kw.items() if k not in ("chunk", "progress")})
    settings = dict(cache=cfg.cache, window=cfg.window_n, sinks=cfg.sinks_n, positions=cfg.positions,
                    chunk=kw.get("chunk", SCORE_CHUNK), cache_dtype=cfg.cache_dtype,
                    quantized_sinks=cfg.quantized_sinks, cache_dtype_v=cfg.cache_dtype_v or cfg.cache_dtype,
                    rotate_k=CacheSpec(batch=1, kv_heads=1, head_dim=1, dtype=cfg.cache_dtype,
                                       rotate_k=cfg.rotate_k).rotate_k)
    return {**settings, "tokens": int(nll.size), "ppl": float(np.exp(nll.mean())),
            "buckets": bucket_perplexity(nll, bucket), "seconds": round(seconds, 2),
            "tok_s": round(nll.size / seconds, 1)}


def label(r: dict) -> str:
    """Short legend text of one result: 'sinks 4 + window 1020, cache positions'."""
    if r["cache"] == "full":
        return "full cache"
    text = f"window {r['window']}" if r["cache"] == "window" else f"sinks {r['sinks']} + window {r['window']}"
    return text + (f", {r['positions']} positions" if r["cache"] == "sinks" else "")


def plot(results: list, path, *, title: str = "", trained_context: int | None = None) -> None:
    """PNG of per-bucket perplexity against position, one line per result of :func:`perplexity`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for r in results:
        mid = [(b["start"] + b["end"]) / 2 for b in r["buckets"]]
        ax.plot(mid, [b["ppl"] for b in r["buckets"]], marker=".", label=label(r))
    if trained_context:
        ax.axvline(trained_context, color="grey", ls="--", lw=1)
        ax.text(trained_context, ax.get_ylim()[1], " trained context", va="top", color="grey", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("position in the text (tokens)")
    ax.set_ylabel("perplexity per bucket (log scale)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(p) -> None:
    """Arguments of ``streamattn perplexity``."""
    p.add_argument("file", help="UTF-8 text file to score (e.g. out/texts/... from scripts/get_text.sh)")
    from streamattn.engine.options import add_arguments as add_model_arguments
    add_model_arguments(p, chat=False)             # the flags every subcommand shares (--prefill-chunk: tokens
    #                                                per forward call)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    p.add_argument("--bucket", type=int, default=1000, help="positions per reported bucket")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    p.add_argument("--png", default=None, help="write perplexity against position here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")


def progress_bar(quiet: bool) -> Callable[[int, int, float], None] | None:
    """A one-line stderr progress bar for :func:`token_losses` (None when quiet)."""
    if quiet:
        return None
    t0 = time.perf_counter()

    def show(done, total, nll_sum):
        rate = done / max(time.perf_counter() - t0, 1e-9)
        bar = "#" * int(30 * done / total)
        print(f"\r[{bar:<30}] {done}/{total} tokens, {rate:.0f} tok/s, ppl so far {np.exp(nll_sum / done):.2f}, "
              f"eta {(total - done) / rate:.0f}s", end="\n" if done == total else "", file=sys.stderr, flush=True)
    return show


MAX_TEXT_BYTES = 1 << 30     # a text file to score (a 1 GiB text is ~250M tokens: days of scoring)


def read_text_file(file) -> str:
    """The UTF-8 text of ``file``, read through :func:`streamattn.runtime.files.read_text`: a missing file is
    FileNotFoundError, a folder, FIFO or device, a file over MAX_TEXT_BYTES or one that is not UTF-8 is
    :class:`~streamattn.runtime.files.BadFile`, each naming the file."""
    if not os.path.lexists(file):
        raise FileNotFoundError(f"text file {str(file)!r} not found (scripts/get_text.sh writes a long one)")
    return read_text(file, limit=MAX_TEXT_BYTES, what="text file")


def load_ids(file, tokenizer, max_tokens: int | None = None, *, text: str | None = None) -> list:
    """Token ids of a text file (the first ``max_tokens + 1`` of them: that many are scored).

    With ``max_tokens`` only a prefix of the text is tokenized: enough characters for twice that many
    tokens (``tokenizer.max_token_bytes`` each), cut at a space or newline, so the work is bounded by
    ``max_tokens`` and not by the file. ``text``: the file's contents when already read.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"--max-tokens must be an integer >= 1 (got {max_tokens!r})")
    text = read_text_file(file) if text is None else text
    if max_tokens is not None:
        room = 2 * (max_tokens + 1) * tokenizer.max_token_bytes
        if len(text) > room:
            cut = max(text.rfind(" ", room // 2, room), text.rfind("\n", room // 2, room))
            text = text[:cut if cut > 0 else room]
        ids = tokenizer.encode(text)[:max_tokens + 1]
    else:
        ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError(f"{file} holds {len(ids)} token(s); perplexity needs at least 2")
    return ids


def check_args(args) -> str:
    """Every argument checked before the model loads (so no result is lost to a bad flag after the
    work): the numbers, the output paths (``--json``, ``--png``: a writable file in an existing folder),
    and the text file itself, whose contents are returned."""
    from streamattn.engine.options import ModelOptions
    ModelOptions.from_args(args)                  # the shared flags: --prefill-chunk, --window, --threads ...
    if args.bucket < 1:
        raise ValueError(f"--bucket must be >= 1 (got {args.bucket})")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    for flag, out in (("--json", args.json), ("--png", args.png)):
        if out:
            check_writable(out, what=f"{flag} output file")
    if args.json and args.png and same_file(args.json, args.png) or (args.json and args.json == args.png):
        raise ValueError(f"--json and --png name the same file {args.json}; give two files")
    for flag, out in (("--json", args.json), ("--png", args.png)):
        if out and (same_file(out, args.file) or os.path.abspath(out) == os.path.abspath(args.file)):
            raise ValueError(f"{flag} {out} is the text file being scored; give another file")
    return read_text_file(args.file)


def run_args(args) -> int:
    """``streamattn perplexity``: score the file, print or write the JSON, draw the PNG."""
    from streamattn.engine.options import ModelOptions
    from streamattn.gguf.hub import resolve_model

    text = check_args(args)
    opts = ModelOptions.from_args(args)
    path = resolve_model(opts.model, quiet=args.quiet)
    tf, tok, m = replace(opts, model=str(path)).load()
    ids = load_ids(args.file, tok, args.max_tokens, text=text)
    r = perplexity(tf, ids, cache=opts.cache, window=opts.window, sinks=opts.sinks, positions=opts.positions,
                   chunk=opts.prefill_chunk, backend=opts.backend, bucket=args.bucket, cache_dtype=opts.k_dtype,
                   cache_dtype_v=opts.v_dtype, quantized_sinks=opts.quantized_sinks,
                   rotate_k=opts.rotate_k,
                   progress=progress_bar(args.quiet))
    r = {"file": str(args.file), "model": path.name, **r}
    text = json.dumps(r, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    if args.png:
        plot([r], args.png, title=f"{path.name}: {Path(args.file).name}",
             trained_context=m.config.context_length or None)
    if not args.quiet:
        print(f"{label(r)}: perplexity {r['ppl']:.3f} over {r['tokens']} tokens ({r['tok_s']} tok/s)",
              file=sys.stderr)
    return 0
