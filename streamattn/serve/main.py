"""The ``streamattn serve`` subcommand: arguments -> ServeConfig -> uvicorn."""

from __future__ import annotations

import argparse

from streamattn.serve.config import BACKENDS, CACHE_DTYPES, CACHE_MODES, POSITIONS, WEIGHTS, ServeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    p.add_argument("--model", default=None,
                   help="a .gguf path or a model name (smollm2-135m, gemma3-270m); default smollm2-135m")
    p.add_argument("--model-id", default=None, help="name clients must send as 'model' (default: the file stem)")
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--parallel", type=int, default=d.parallel, help="sequence slots decoded as one batch")
    p.add_argument("--cache", choices=CACHE_MODES, default=d.cache)
    p.add_argument("--window", type=int, default=None, help="window n_c for --cache window|sinks (default 256)")
    p.add_argument("--sinks", type=int, default=d.sinks, help="sink tokens for --cache sinks")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests before 429")
    p.add_argument("--prompt-cache-mb", type=float, default=d.prompt_cache_mb, help="prompt cache size (0: off)")
    p.add_argument("--threads", type=int, default=d.threads, help="CPU threads for matmuls and attention")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend)
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prompt tokens per sequence per engine step")
    p.add_argument("--cache-dtype", choices=CACHE_DTYPES, default=d.cache_dtype)
    p.add_argument("--positions", choices=POSITIONS, default=d.positions,
                   help="RoPE positions in the text or within the cache (StreamingLLM, for --cache sinks)")
    p.add_argument("--weights", choices=WEIGHTS, default=d.weights,
                   help="quant: the GGUF's packed blocks (default); f32: dequantized float32 reference")
    p.add_argument("--max-body-mb", type=float, default=d.max_body_mb,
                   help="largest request body accepted, MiB (larger: 413)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.add_argument("--debug-fail-text", default=None, help=argparse.SUPPRESS)
    from streamattn.scale.ray_serve import add_arguments as add_ray_arguments
    add_ray_arguments(p)                                   # --ray --replicas N: Ray Serve replicas


def config_from_args(args) -> ServeConfig:
    return ServeConfig(model=args.model, model_id=args.model_id, host=args.host, port=args.port,
                       parallel=args.parallel, cache=args.cache, window=args.window, sinks=args.sinks,
                       max_queue=args.max_queue, prompt_cache_mb=args.prompt_cache_mb, threads=args.threads,
                       backend=args.backend, prefill_chunk=args.prefill_chunk, cache_dtype=args.cache_dtype,
                       positions=args.positions, weights=args.weights, max_body_mb=args.max_body_mb,
                       debug_fail_text=args.debug_fail_text)


def run_args(args) -> int:
    cfg = config_from_args(args)
    if args.ray:
        from streamattn.scale.ray_serve import run_args as run_on_ray
        return run_on_ray(cfg, args)
    try:
        import uvicorn
        from streamattn.serve.app import build_app
    except ImportError as e:
        raise ValueError(f"streamattn serve needs the 'serve' extra ({e}); pip install 'streamattn[serve]'")
    uvicorn.run(build_app(cfg), host=cfg.host, port=cfg.port, log_level=args.log_level)
    return 0
