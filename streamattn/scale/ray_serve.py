"""Ray Serve replicas of the ``streamattn serve`` app: one engine per replica, Serve routes between them.

Each replica builds the same FastAPI app as ``streamattn serve`` (``build_app(ServeConfig)``), so each runs
its own model, engine thread, batch of ``parallel`` sequence slots and prompt cache. Serve's proxy spreads
requests over the replicas; streaming responses pass through it as they are produced.

Sizing, tied to the engine:

==========================  ======================================================================
``max_ongoing_requests``    ``parallel``: a replica takes only as many requests as it decodes at once;
                            the rest wait in Serve's router, which sends each to the replica with
                            the fewest (power of two choices), instead of one engine's queue
``max_queued_requests``     ``max_queue``: past it Serve answers 503 with Retry-After (the plain
                            server answers 429)
``num_cpus`` per replica    ``threads`` unless given: the engine's matmul/attention threads
autoscaling                 between ``min_replicas`` and ``max_replicas`` with ``target_ongoing_requests
                            = parallel``: a new replica starts when requests queue at full batches
==========================  ======================================================================

Started by ``streamattn serve --ray --replicas N`` (or ``--autoscale MIN:MAX``), or with Serve's CLI::

    serve run streamattn.scale.ray_serve:app_builder model=smollm2-135m parallel=4 replicas=2

(there Serve's own HTTP options choose the port, 8000 by default; ``host``/``port`` of the config apply to
``streamattn serve --ray``, which starts Serve's proxy on them).

Readiness: the app loads its model in a thread after startup and answers 503 on ``/health`` until then.
The replica's lifespan here waits for ``/health`` to answer 200 before Serve counts the replica as
running, so Serve never routes to a replica that is still loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import time

DEFAULT_APP = "streamattn.serve:build_app"


def _build_app(app_path: str, config):
    module, _, name = app_path.partition(":")
    return getattr(importlib.import_module(module), name)(config)


def _wait_ready(app, path: str = "/health", timeout_s: float = 900.0):
    """Wrap ``app``'s lifespan so that startup ends only once GET ``path`` answers 200 (or raises after
    ``timeout_s`` with the last answer)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        import httpx
        async with inner(a) as state:
            deadline = time.monotonic() + timeout_s
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://replica") as c:
                while (r := await c.get(path)).status_code != 200:
                    failed = r.headers.get("content-type", "").startswith("application/json") and \
                        r.json().get("status") == "error"
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"replica not ready: GET {path} answered {r.status_code} {r.text[:300]}")
                    await asyncio.sleep(0.2)
            yield state

    app.router.lifespan_context = lifespan
    return app


def _sizing(config, replicas, autoscale, cpus_per_replica):
    """(Serve scaling kwargs, CPUs per replica), checked (before anything starts)."""
    if autoscale is not None:
        lo, hi = autoscale
        if not (1 <= lo <= hi):
            raise ValueError(f"autoscale must be (min, max) with 1 <= min <= max (got {autoscale})")
        scale = dict(autoscaling_config=dict(min_replicas=lo, max_replicas=hi,
                                             target_ongoing_requests=config.parallel))
    else:
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1 (got {replicas!r})")
        scale = dict(num_replicas=replicas)
    cpus = float(config.threads if cpus_per_replica is None else cpus_per_replica)
    if cpus <= 0:
        raise ValueError(f"cpus_per_replica must be > 0 (got {cpus_per_replica})")
    return scale, cpus


def deployment(config, *, replicas: int | None = 1, autoscale: tuple | None = None,
               cpus_per_replica: float | None = None, app_path: str = DEFAULT_APP):
    """A bound Ray Serve application serving ``app_path(config)`` on each replica.

    Parameters
    ----------
    config : ServeConfig
        The server's settings (any frozen dataclass ``app_path`` accepts); ``parallel``, ``max_queue``
        and ``threads`` size the deployment (see the module docstring).
    replicas : int, optional
        Fixed replica count (ignored when ``autoscale`` is given).
    autoscale : (int, int), optional
        (min_replicas, max_replicas) for Serve's autoscaler.
    cpus_per_replica : float, optional
        CPUs Ray reserves per replica (default ``config.threads``).
    app_path : str
        ``"module:function"`` building the ASGI app from ``config`` on the replica.

    Returns
    -------
    ray.serve.Application
        Pass to ``serve.run(app, route_prefix="/")``.
    """
    scale, cpus = _sizing(config, replicas, autoscale, cpus_per_replica)
    from ray import serve
    fields = dataclasses.asdict(config)
    config_cls = type(config)

    @serve.ingress(None)
    class StreamattnReplica:
        """One replica: the server app with its own engine (built on the replica, not pickled)."""

        def __init__(self, fields: dict):
            self.config = config_cls(**fields)

        def __serve_build_asgi_app__(self):
            return _wait_ready(_build_app(app_path, self.config))

    dep = serve.deployment(StreamattnReplica, name="streamattn", max_ongoing_requests=config.parallel,
                           max_queued_requests=config.max_queue, ray_actor_options={"num_cpus": cpus},
                           health_check_timeout_s=60, **scale)
    return dep.bind(fields)


def run(config, *, replicas: int | None = 1, autoscale: tuple | None = None, cpus_per_replica: float | None = None,
        address: str | None = None, blocking: bool = True, app_path: str = DEFAULT_APP):
    """Start Serve's HTTP proxy on ``config.host:config.port`` and deploy the replicas (route ``/``).

    Joins ``address`` (or RAY_ADDRESS), else starts a local Ray (127.0.0.1). With ``blocking`` it serves
    until interrupted and then shuts Serve and a Ray it started down; otherwise it returns once every
    replica is running (the caller calls :func:`shutdown`).
    """
    from streamattn.scale.ray_batch import ray_up, init_ray
    _sizing(config, replicas, autoscale, cpus_per_replica)
    was_up = ray_up()
    init_ray(address)
    from ray import serve
    up = False
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(deployment(config, replicas=replicas, autoscale=autoscale, cpus_per_replica=cpus_per_replica,
                             app_path=app_path), name="streamattn", route_prefix="/")
        up = True
        if not blocking:
            return
        print(f"streamattn: serving on http://{config.host}:{config.port}/v1 "
              f"({'autoscale %d..%d' % autoscale if autoscale else f'{replicas} replicas'}); Ctrl-C stops")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if blocking or not up:
            shutdown(stop_ray=not was_up)


def shutdown(*, stop_ray: bool = False):
    """Stop Serve (replicas and proxy); with ``stop_ray`` also this process's Ray."""
    import ray
    from ray import serve
    serve.shutdown()
    if stop_ray:
        ray.shutdown()


def add_arguments(p) -> None:
    """The Ray flags of ``streamattn serve`` (the server's own flags give the ServeConfig)."""
    p.add_argument("--ray", action="store_true", help="serve through Ray Serve replicas (one engine each)")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: fixed replica count")
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="with --ray: let Serve scale between MIN and MAX replicas")
    p.add_argument("--cpus-per-replica", type=float, default=None, help="with --ray: default --threads")
    p.add_argument("--ray-address", default=None, help="with --ray: cluster to join (default: a local Ray)")


def run_args(config, args) -> int:
    """``streamattn serve --ray ...``: serve ``config`` on Ray Serve until interrupted."""
    autoscale = None
    if args.autoscale:
        try:
            lo, hi = (int(x) for x in args.autoscale.split(":"))
        except ValueError:
            raise ValueError(f"--autoscale must be MIN:MAX, e.g. 1:4 (got {args.autoscale!r})") from None
        autoscale = (lo, hi)
    run(config, replicas=args.replicas, autoscale=autoscale, cpus_per_replica=args.cpus_per_replica,
        address=args.ray_address)
    return 0


def app_builder(args: dict):
    """Entry point of ``serve run streamattn.scale.ray_serve:app_builder key=value ...``.

    Keys: every ServeConfig field (``model``, ``parallel``, ``cache``, ``window``, ...), plus ``replicas``,
    ``min_replicas``/``max_replicas`` (autoscaling) and ``cpus_per_replica``. Values arrive as strings.
    """
    from streamattn.serve import ServeConfig
    args = dict(args)
    rep = args.pop("replicas", None)
    lo, hi = args.pop("min_replicas", None), args.pop("max_replicas", None)
    cpus = args.pop("cpus_per_replica", None)
    types = {f.name: f.type for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; expected ServeConfig fields {sorted(types)} or replicas, "
                         f"min_replicas, max_replicas, cpus_per_replica")
    cfg = ServeConfig(**{k: _coerce(v, types[k]) for k, v in args.items()})
    return deployment(cfg, replicas=int(rep) if rep else 1,
                      autoscale=(int(lo), int(hi)) if lo or hi else None,
                      cpus_per_replica=float(cpus) if cpus else None)


def _coerce(v, annotation):
    """A ``serve run`` string as the ServeConfig field's type ("int | None", "float", "str | None", ...)."""
    if not isinstance(v, str):
        return v
    t = str(annotation)
    if "None" in t and v.lower() in ("", "none", "null"):
        return None
    if t.startswith("int"):
        return int(v)
    if t.startswith("float"):
        return float(v)
    if t.startswith("bool"):
        return v.lower() in ("1", "true", "yes")
    return v
