"""What a cache storage not run before costs to compile: issue 52's "kernels compiled for one cache dtype do
not recompile for another".

    PYTHONPATH=. python benchmarks/compile_per_storage.py [--model smollm2-135m] [--storages float32 q8_0 float16]
                                                          [--cache-dir DIR]

Empties Numba's cache directory ``DIR`` (default: a new temporary one), then warms the model
(``engine.generate.warm_model``, what ``streamattn generate`` runs before its first token; one thread) in a
fresh process per storage, in the order given, so each storage after the first finds the others' kernels on
disk; then one more process warms them all, from the disk cache alone. For each: wall and CPU seconds of the
warm-up and the functions whose compile began outside any other (each with the seconds its compile took,
nested ones included), from Numba's ``numba:compile`` events. CPU seconds compare across a shared host's
loads better than wall. Run it from another checkout's root (``cd OTHER && PYTHONPATH=. python
PATH/benchmarks/compile_per_storage.py``) to measure that checkout's code.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _warm(model: str, storages: list) -> list:
    """In this process: warm ``model`` for each storage; [(storage, wall s, cpu s, [(function, s)])]."""
    from numba.core import event

    from streamattn.engine.generate import warm_model
    from streamattn.gguf.hub import resolve_model
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    from streamattn.runtime.threads import set_threads
    set_threads(1)
    tf = Transformer(load_gguf(resolve_model(model, quiet=True)))
    top, depth = [], []

    class Starts(event.Listener):
        def on_start(self, ev):
            depth.append(time.perf_counter())

        def on_end(self, ev):
            t0 = depth.pop()
            if not depth:
                top.append((ev.data["dispatcher"].py_func.__qualname__, round(time.perf_counter() - t0, 1)))
    out = []
    with event.install_listener("numba:compile", Starts()):
        for s in storages:
            del top[:]
            w, c = time.perf_counter(), time.process_time()
            warm_model(tf, s)
            out.append((s, round(time.perf_counter() - w, 1), round(time.process_time() - c, 1), list(top)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--storages", nargs="+", default=["float32", "q8_0", "float16"])
    ap.add_argument("--cache-dir", help="Numba's cache directory, emptied first (default: a new temporary one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_warm(args.model, args.storages)))
        return
    cache = args.cache_dir or tempfile.mkdtemp(prefix="numba-cache-")
    subprocess.run(["rm", "-rf", cache], check=True)
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    runs = [[s] for s in args.storages] + [args.storages]
    for storages in runs:
        load = os.getloadavg()[0]
        done = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--storages", *storages],
                              env=env, check=True, capture_output=True, text=True)
        for s, wall, cpu, top in json.loads(done.stdout.splitlines()[-1]):
            print(f"{'+'.join(storages):<24} {s:<8} wall {wall:6.1f} s  cpu {cpu:6.1f} s  load {load:5.1f}  "
                  f"compiled: {', '.join(f'{n} {t}' for n, t in top) or 'nothing'}", flush=True)


if __name__ == "__main__":
    main()
