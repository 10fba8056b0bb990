"""The GPU decode step's layer row work as CUDA graphs (streamattn.models.gpu_graph), through the fake CuPy:
its capture records kernel launches and replays them, and raises on a host sync, an upload or an array op
inside a capture, so a model that runs proves each captured segment is kernel launches only. A packed model
with graphs gives the same logits, bit for bit, and the same greedy ids as without, over decode steps whose
attention changes its split count as the context grows; a replayed step syncs the host once."""
from __future__ import annotations

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
import sys
import numpy as np
import cupy
sys.path.insert(0, "tests")
from _model_util import write_tiny_gguf
from streamattn.gguf.loader import load_gguf
from streamattn.kv.backends import gpu_plan, gpu_source
from streamattn.models.transformer import Transformer

gpu_source.MIN_KEYS_PER_SPLIT = 2            # the split count grows within a few steps of a tiny context
splits = []
choose = gpu_plan.choose_splits
gpu_plan.choose_splits = lambda *a: splits.append(choose(*a)) or splits[-1]
types = dict(attn_q="Q8_0", attn_k="Q8_0", attn_v="Q8_0", attn_output="Q5_0", ffn_gate="Q4_0", ffn_up="Q4_0",
             ffn_down="Q4_1", token_embd="Q8_0")     # one type a fused matrix (a row group tuple is not graphed)
path = write_tiny_gguf(sys.argv[1], arch=sys.argv[2], n_layers=2, d_model=32, n_heads=1, n_kv_heads=1, head_dim=64,
                       d_ff=32, vocab=40, quant=types, matrix_scale=0.1)
plain, graphed = (Transformer(load_gguf(path, weights="gguf")).to(cupy) for _ in range(2))
graphed.cuda_graphs = True
if sys.argv[3] == "planted":                 # an array op in the row work: the capture must refuse it
    from streamattn.models import gpu_ops
    gpu_ops.GpuOps.residual = lambda self, x, y, w: self._op("residual", (x, y, w), lambda: x.__iadd__(y))
    plain.cuda_graphs = True
caches = [m.new_caches(batch=2, max_chunk=3) for m in (plain, graphed)]
feeds = [np.array([[3], [9]])] * 2
syncs, same = [], True
for step in range(4):
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
steps, launched = g.steps, cupy.counts.get("graph_launch", 0)
uploads, ids = [], cupy.asarray(feeds[1])
for step in range(3):        # greedy ids picked on the device: the step uploads nothing (ids, positions, rows)
    a = plain.forward(feeds[0], caches[0], backend="gpu", last_only=True)
    before = cupy.counts["upload"]
    b = graphed.forward(ids, caches[1], backend="gpu", last_only=True)
    uploads.append(cupy.counts["upload"] - before)
    ids = b.argmax(-1)[:, None]                                  # on the device
    same &= hasattr(ids, "__cuda_array_interface__") and np.array_equal(a.get(), b.get())
    feeds[0] = a.get().argmax(-1)[:, None]
held = [c.lengths.copy() for c in caches[1]]
try:                         # an id outside the 40-token table, on the device: a NaN row the step refuses
    graphed.forward(cupy.asarray(np.array([[3], [40]])), caches[1], backend="gpu", last_only=True)
    refused = False
except ValueError:
    refused = all(np.array_equal(c.lengths, h) for c, h in zip(caches[1], held))
print("ok", same, syncs == [1] * 3, steps, len(g.segments), launched, len(set(splits)) > 1, uploads == [0] * 3,
      refused)
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


def _run(tmp_path, lib, arch: str, variant: str):
    env = dict(os.environ, STREAMATTN_FAKE_CUPY_LIB=str(lib), PYTHONPATH=f"{ROOT / 'tests' / 'fake_cupy'}:{ROOT}")
    return subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "g.gguf"), arch, variant], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_graphed_decode_equals_plain_launches(tmp_path, emu_library, arch):
    """Four decode steps of batch 2: the first plain, the second captured, the rest replayed; three segments
    a step (before the first attention, between, after the last); the attention's split count grows from 1
    to 2 on the way (the threshold lowered for a tiny context). Qwen2's q/k/v bias is added by the heads
    kernel, so its steps are graphed too. Then three steps fed the ids of a device argmax: the same logits as
    host ids, and nothing uploaded (ids, positions from the device lengths, the last rows by a slice); an id
    outside the table, on the device, is refused by the step's finite check, the caches as before."""
    done = _run(tmp_path, emu_library, arch, "")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    word, same, one_sync, steps, segments, launches, split_change, no_upload, refused = done.stdout.split()
    assert (word, same, one_sync, split_change, no_upload, refused) == ("ok",) + ("True",) * 5, done.stdout
    assert (int(steps), int(segments)) == (4, 3)
    assert int(launches) == 3 * 3                 # captured at step 2, replayed at 3 and 4


def test_an_array_op_inside_a_capture_is_refused(tmp_path, emu_library):
    done = _run(tmp_path, emu_library, "llama", "planted")
    assert done.returncode != 0
    assert "array operation __iadd__ inside a stream capture" in done.stderr, done.stderr[-3000:]


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
