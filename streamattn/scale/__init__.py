"""Past one process: offline batch generation (``streamattn batch``, locally or on Ray Data) and Ray Serve
replicas of the ``streamattn serve`` app.

Modules: jobs (JSON-lines requests and resumable output), batch (the local runner), command (the
``streamattn batch`` command),
ray_batch (Ray Data map_batches with one model per actor), ray_serve (the Serve deployment).
Ray is an optional extra (``pip install 'streamattn[ray]'``); only the ray_* modules import it.
"""
