"""The GPU decode step's layer row work as CUDA graphs (streamattn.models.gpu_graph), through the fake CuPy:
its capture records kernel launches and replays them, and raises on a host sync, an upload or an array op
inside a capture, so a model that runs proves each captured segment is kernel launches only. A packed model
with graphs gives the same logits, bit for bit, and the same greedy ids as without, over decode steps whose
attention changes its split count as the context grows; a replayed step syncs the host once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from cuda_emu import emu
from streamattn.kv.backends import gpu_source
from streamattn.models.gpu_graph import StepGraph

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")

CHILD = r"""
import json
import sys
import numpy as np
import cupy
sys.path.insert(0, "tests")
from _model_util import write_tiny_gguf
from streamattn.gguf.loader import load_gguf
from streamattn.kv.backends import gpu_plan, gpu_source
from streamattn.models import gpu_ops
from streamattn.models.transformer import Transformer

gpu_source.MIN_KEYS_PER_SPLIT = 1            # the split count grows step by step in a tiny context
splits = []
choose = gpu_plan.choose_splits
gpu_plan.choose_splits = lambda *a: splits.append(choose(*a)) or splits[-1]
types = dict(attn_q="Q8_0", attn_k="Q8_0", attn_v="Q8_0", attn_output="Q5_0", ffn_gate="Q4_0", ffn_up="Q4_0",
             ffn_down="Q4_1", token_embd="Q8_0")     # one type a fused matrix (a row group tuple is not graphed)


def models(arch):
    path = write_tiny_gguf(f"{sys.argv[1]}/{arch}.gguf", arch=arch, n_layers=2, d_model=32, n_heads=1,
                           n_kv_heads=1, head_dim=64, d_ff=32, vocab=40, quant=types, matrix_scale=0.1)
    plain, graphed = (Transformer(load_gguf(path, weights="gguf")).to(cupy) for _ in range(2))
    graphed.cuda_graphs = True
    return plain, graphed


def refused(model, ids, caches):
    held = [c.lengths.copy() for c in caches]
    try:
        model.forward(ids, caches, backend="gpu", last_only=True)
        return False
    except ValueError:
        return all(np.array_equal(c.lengths, h) for c, h in zip(caches, held))


report = {}
for arch in ("llama", "qwen2"):
    splits.clear()
    plain, graphed = models(arch)
    caches = [m.new_caches(batch=2, max_chunk=3) for m in (plain, graphed)]
    feeds = [np.array([[3], [9]])] * 2
    syncs, same, launched = [], True, cupy.counts.get("graph_launch", 0)
    for step in range(3):                    # plain, captured, replayed
        out = []
        for m, cc, feed in zip((plain, graphed), caches, feeds):
            before = cupy.counts["sync"]
            logits = m.forward(feed, cc, backend="gpu", last_only=True)
            if m is graphed and step:
                syncs.append(cupy.counts["sync"] - before)
            out.append(logits.get())
        same &= np.array_equal(out[0], out[1])
        feeds = [o.argmax(-1)[:, None] for o in out]
        same &= np.array_equal(feeds[0], feeds[1])
    g = graphed.step_graphs[2]
    r = report[arch] = dict(same=bool(same), syncs=syncs, steps=g.steps, segments=len(g.segments),
                            launched=cupy.counts.get("graph_launch", 0) - launched, splits=sorted(set(splits)))
    if arch != "llama":
        continue
    # greedy ids picked on the device (the replayed step's argmax): the step uploads nothing (ids,
    # positions, rows)
    ids = logits.argmax(-1)[:, None]
    a = plain.forward(feeds[0], caches[0], backend="gpu", last_only=True)
    before = cupy.counts["upload"]
    b = graphed.forward(ids, caches[1], backend="gpu", last_only=True)
    on_device = hasattr(ids, "__cuda_array_interface__")
    r.update(device_same=bool(same and on_device and np.array_equal(a.get(), b.get())),
             uploads=[cupy.counts["upload"] - before])
    # ids outside the 40-token table, on the device: NaN rows the step refuses, the caches as before; an
    # int64 id past int32 (2**32 + 3) must not wrap into row 3
    r["refused"] = [refused(graphed, cupy.asarray(np.array([[3], [v]], dt)), caches[1])
                    for v, dt in ((40, np.int32), (2**32 + 3, np.int64))]
# an array op in the row work: the capture must refuse it
gpu_ops.GpuOps.residual = lambda self, x, y, w: self._op("residual", (x, y, w), lambda: x.__iadd__(y))
plain, _ = models("llama")
plain.cuda_graphs = True
caches = plain.new_caches(batch=2, max_chunk=3)
try:
    for step in range(2):
        plain.forward(np.array([[3], [9]]), caches, backend="gpu", last_only=True)
    report["planted"] = "not refused"
except RuntimeError as e:
    report["planted"] = str(e)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def emu_library(tmp_path_factory):
    """The emulation library of the kernels these models launch alone (float32 caches, head_dim 64, four
    GGUF types): a fraction of the full library's build."""
    used = ("gemv_q8_0", "gemv_q4_0", "gemv_q4_1", "gemv_q5_0", "layer_", "embed_q8_0", "decode_f32_hd64",
            "decode_f32_hd64_softcap", "merge_hd64", "prefill_f32_hd64", "prefill_f32_hd64_softcap",
            "append_f32_hd64")
    specs = [n for n in gpu_source.all_specs() if n.startswith(used)]
    kinds = {n.split("_")[0] for n in specs}
    return emu.build(tmp_path_factory.mktemp("graph_emu"), sources={k: gpu_source.source(k) for k in kinds},
                     specs=specs)


@pytest.fixture(scope="module")
def report(tmp_path_factory, emu_library):
    """One child for every model run here (the fake CuPy is process-wide): its JSON report."""
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(emu_library),
               PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path_factory.mktemp("graph_models"))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graphed_decode_equals_plain_launches(report, arch):
    """Three decode steps of batch 2: the first plain, the second captured, the third replayed, each with
    the same logits and greedy ids as plain launches and one host sync; three segments a step (before the
    first attention, between, after the last); the attention's split count (outside the graphs) grows on
    the way, the threshold lowered for a tiny context. Qwen2's q/k/v bias is added by the heads kernel, so
    its steps are graphed too."""
    r = report[arch]
    assert r["same"] and r["syncs"] == [1, 1], r
    assert (r["steps"], r["segments"]) == (3, 3)
    assert r["launched"] == 3 * 2                 # each segment launched at its capture and its replay
    assert len(r["splits"]) > 1, r


def test_device_ids_upload_nothing_and_bad_ids_are_refused(report):
    """A step fed the ids of a device argmax: the same logits as host ids, and nothing uploaded (ids,
    positions from the device lengths, the last rows by a slice). Ids outside the table on the device (an
    int32 40, an int64 2**32 + 3 that an int32 cast would wrap into row 3) are refused by the step's finite
    check, the caches as before."""
    r = report["llama"]
    assert r["device_same"] and r["uploads"] == [0], r
    assert r["refused"] == [True, True], r


def test_an_array_op_inside_a_capture_is_refused(report):
    assert "array operation __iadd__ inside a stream capture" in report["planted"], report["planted"]


class _Stream:
    """A stand-in stream: a capture collects the callables its launches would be; a graph runs them."""

    def __init__(self, non_blocking=False):
        self.open = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self):
        self.open = []

    def end_capture(self):
        recorded, self.open = self.open, None
        return types.SimpleNamespace(launch=lambda stream=None: LAUNCHED.append(stream) or [f() for f in recorded])

    def record(self):
        return self

    def wait_event(self, event):
        pass


LAUNCHED = []                 # the streams the stand-in graphs were launched on


def test_step_graph_replays_results_and_refuses_other_buffers():
    """Plain, capture, replay: on replay an op's Python does not run and gets the capture's result; the same
    op on another buffer, or a segment closed before all its ops, raises instead of replaying stale work."""
    current = _Stream()
    xp = types.SimpleNamespace(zeros=np.zeros, float32=np.float32, int32=np.int32,
                               cuda=types.SimpleNamespace(Stream=_Stream, get_current_stream=lambda: current))
    g = StepGraph(xp, 2, 4, 4)
    a, b = np.ones(4, np.float32), np.ones(4, np.float32)
    ran = []

    def step(arg):
        g.begin_step()
        out = g.op("scale", (arg,), lambda: ran.append(g.mode) or arg * 2)
        g.close()
        return out

    first, second, third = step(a), step(a), step(a)
    assert ran == ["plain", "capture"] and third is second and np.array_equal(first, second)
    assert len(g.segments) == 1 and g.mode == "replay"
    assert LAUNCHED == [current, current]      # on the step's stream (after its attention), not the graph's
    with pytest.raises(RuntimeError, match="other buffers"):
        step(b)
    g.abort()
    g.begin_step()
    with pytest.raises(RuntimeError, match="ran 0 of its 1 ops"):      # the segment's op never asked for
        g.close()


def test_sink_queries_keep_a_call_on_the_array_ops():
    """One rule (array_ops.rotates_sink_queries) sends a call whose queries are also rotated at sinks-cache
    positions to the array ops: the step graphs stand aside and GpuOps refuses it, other calls go on."""
    from streamattn.models.array_ops import rotates_sink_queries
    from streamattn.models.gpu_graph import graphable
    from streamattn.models.gpu_ops import GpuOps

    def caches(*sinks):
        return [types.SimpleNamespace(spec=types.SimpleNamespace(sinks=s)) for s in sinks]

    tf = types.SimpleNamespace(cuda_graphs=True, layers=[])
    for positions, sinks, rotates in [("cache", (0, 2), True), ("cache", (0, 0), False),
                                      ("absolute", (2, 2), False)]:
        cc = caches(*sinks)
        assert rotates_sink_queries(positions, cc) is rotates
        assert graphable(tf, 1, 1, positions, cc) is not rotates
    with pytest.raises(ValueError, match="positions='cache' with a sinks cache"):
        GpuOps(None, caches(1), None, "gpu", None, None, "cache", None, None)
