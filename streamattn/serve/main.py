"""The ``streamattn serve`` subcommand: arguments -> ServeConfig -> uvicorn. (``--ray``, replicas on Ray
Serve, is :mod:`streamattn.scale.ray_serve`'s: the CLI adds its flags and hands it the config, so that
serving never imports the scale package that builds on it.)"""

from __future__ import annotations

import argparse

from streamattn.engine.options import ModelOptions, add_arguments as add_model_arguments
from streamattn.serve.config import POOLINGS, ServeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    add_model_arguments(p, prefill_chunk=d.prefill_chunk, chat=False)   # the flags every subcommand shares
    p.add_argument("--model-id", default=None, help="name clients must send as 'model' (default: the file stem)")
    p.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--parallel", type=int, default=d.parallel, help="sequence slots decoded as one batch")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests before 429")
    p.add_argument("--prompt-cache-mb", type=float, default=d.prompt_cache_mb, help="prompt cache size (0: off)")
    from streamattn.engine.speculative import add_arguments as add_speculative_arguments
    add_speculative_arguments(p)                           # the default of requests that do not say
    p.add_argument("--max-body-mb", type=float, default=d.max_body_mb,
                   help="largest request body accepted, MiB (larger: 413)")
    p.add_argument("--pooling", choices=POOLINGS, default=d.pooling,
                   help="how /v1/embeddings pools an input's final hidden states (default mean)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.add_argument("--debug-fail-text", default=None, help=argparse.SUPPRESS)


def config_from_args(args) -> ServeConfig:
    opts = ModelOptions.from_args(args)                    # the shared flags' checks and defaults
    opts.check_device()                                    # --device gpu without a device: refused here
    return ServeConfig(model=args.model, model_id=args.model_id, host=args.host, port=args.port,
                       parallel=args.parallel, cache=opts.cache, window=opts.window, sinks=opts.sinks,
                       max_queue=args.max_queue, prompt_cache_mb=args.prompt_cache_mb, threads=args.threads,
                       backend=opts.backend, prefill_chunk=args.prefill_chunk, cache_dtype=opts.k_dtype,
                       cache_dtype_v=opts.v_dtype, quantized_sinks=opts.quantized_sinks,
                       rotate_k=opts.rotate_k,
                       positions=args.positions, weights=args.weights, speculative=args.speculative,
                       draft_max=args.draft_max, max_body_mb=args.max_body_mb, pooling=args.pooling,
                       debug_fail_text=args.debug_fail_text)


def run_args(args) -> int:
    cfg = config_from_args(args)
    try:
        import uvicorn
        from streamattn.serve.app import build_app
    except ImportError as e:
        raise ValueError(f"streamattn serve needs the 'serve' extra ({e}); pip install 'streamattn[serve]'")
    uvicorn.run(build_app(cfg), host=cfg.host, port=cfg.port, log_level=args.log_level)
    return 0
