"""``streamattn batch --ray``: the same batches through Ray Data, one model per actor.

Ray's documented route for offline inference: ``Dataset.map_batches`` with a callable class, so that each
actor of the pool loads the model once in ``__init__`` and then decodes batch after batch. The driver is
the only writer of the output file: it takes records as Ray Data streams them back and writes each id at
most once (:class:`~streamattn.scale.jobs.OutputFile`). When an actor dies mid-batch, Ray Data restarts it
and runs the batch again (its actor pools default to ``max_restarts=-1, max_task_retries=-1``); the lines
of that batch were not written yet, so none is lost and none is written twice.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

import numpy as np

from streamattn.scale.batch import ModelOptions, _take, complete, load_generator
from streamattn.scale.jobs import OutputFile, Progress, Request


def init_ray(address: str | None = None, *, num_cpus: int | None = None):
    """``ray.init`` for this package: join ``address`` (or RAY_ADDRESS), else start a local Ray that
    listens on 127.0.0.1 only, without the dashboard. Returns the ``ray`` module.

    Raises RuntimeError with Ray's own reason when Ray is not installed or cannot start.
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local = not (address or os.environ.get("RAY_ADDRESS"))
    if local:
        # Ray resolves 127.0.0.1 to the host's routable address unless cluster mode is off, which also
        # binds its servers to loopback (ray._private.services.get_node_ip_address). Read at import.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"--ray needs the 'ray' extra: pip install 'streamattn[ray]' ({e})") from None
    if ray.is_initialized():
        return ray
    try:
        if local:
            ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as e:                          # noqa: BLE001 - re-raised with what was tried
        raise RuntimeError(f"Ray could not start ({'local' if local else address}): {type(e).__name__}: {e}")
    return ray


def ray_up() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


class BatchPredictor:
    """Ray Data callable class: loads the model once per actor, then decodes batch after batch.

    Parameters
    ----------
    options : dict
        :class:`~streamattn.engine.options.ModelOptions` fields.
    announce : ray.util.queue.Queue, optional
        Receives this actor's handle once its model is loaded (a monitor counts actors; tests kill one).
    """

    def __init__(self, options: dict, announce=None):
        import ray
        self.opts = ModelOptions(**options)
        self.gen = load_generator(self.opts)
        if announce is not None:
            announce.put(ray.get_runtime_context().current_actor)

    def __call__(self, batch: dict) -> dict:
        """``{"request": [n] JSON strings}`` -> ``{"result": [n] JSON strings}`` (see ``complete``)."""
        from streamattn.runtime.threads import set_threads
        set_threads(self.opts.threads)      # Numba's count is per thread; Ray may call from another thread
        reqs = [Request.from_json(str(s)) for s in batch["request"]]
        results = complete(self.gen, reqs, self.opts)
        return {"result": np.array([json.dumps(r) for r in results], dtype=object)}


def run_ray(requests: list, out: OutputFile, opts: ModelOptions, *, actors: int = 2, cpus_per_actor: float = 1.0,
            batch_size: int = 8, progress: Progress | None = None, address: str | None = None,
            stop_on_error: bool = False, announce=None, on_result=None) -> list:
    """Decode ``requests`` on a pool of ``actors`` Ray actors; write records to ``out`` as they arrive.

    Parameters
    ----------
    requests : list of Request
    out : OutputFile
    opts : ModelOptions
        Each actor builds its Generator from these (the model file must exist on every node).
    actors, cpus_per_actor : int, float
        Pool size and the CPUs Ray reserves for each actor.
    batch_size : int
        Lines per ``map_batches`` batch (decoded together by one actor).
    address : str, optional
        Ray cluster to join; None: RAY_ADDRESS, else a local Ray for this call (stopped after it).
        A Ray already initialised in this process is used as it is.
    stop_on_error, announce, on_result
        As in :func:`~streamattn.scale.batch.run_local`; ``announce``: see :class:`BatchPredictor`.

    Returns
    -------
    list of BadLine
        Requests that could not run.
    """
    errors: list = []
    if not requests:
        return errors
    was_up = ray_up()
    ray = init_ray(address)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.from_items([{"request": r.to_json()} for r in requests],
                                 override_num_blocks=math.ceil(len(requests) / batch_size))
        ds = ds.map_batches(BatchPredictor, fn_constructor_kwargs=dict(options=asdict(opts), announce=announce),
                            batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=actors),
                            num_cpus=cpus_per_actor,
                            batch_format="numpy")
        for row in ds.iter_rows():
            _take(json.loads(row["result"]), out, progress, errors, on_result)
            if errors and stop_on_error:
                break
    finally:
        if not was_up:                              # our local Ray stops; a joined cluster is only left
            ray.shutdown()
    return errors
