"""streamattn.gguf.reader gives what gguf-py's GGUFReader gives, and refuses damaged containers."""

import struct

import gguf
import numpy as np
import pytest

from _model_util import gemma_path, gguf_reader, need_gemma, need_smollm2, smollm2_path, write_tiny_gguf
from streamattn.gguf.reader import GGUFFile
from streamattn.gguf.metadata import read_metadata


def same_as_gguf_reader(path):
    ours, theirs = GGUFFile(path), gguf_reader(path)          # GGUFReader's parse (test below: the same)
    md = read_metadata(theirs, path)
    assert ours.metadata == md
    assert [type(v) for v in ours.metadata.values()] == [type(v) for v in md.values()]   # int stays int
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset) == \
               (b.tensor_type, b.shape.tolist(), b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@need_smollm2
def test_smollm2_as_gguf_reader_reads_it():
    same_as_gguf_reader(smollm2_path())


@need_gemma
def test_gemma3_as_gguf_reader_reads_it():
    """Gemma's 262k-token vocabulary: the case GGUFReader took 8 s for."""
    same_as_gguf_reader(gemma_path())


def test_every_value_type_and_an_alignment(tmp_path):
    """A file with a value of every type GGUFWriter writes (arrays of numbers, strings, bools, nested
    arrays) and a non-default alignment, against GGUFReader."""
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    for i, (fn, v) in enumerate([(w.add_uint8, 7), (w.add_int8, -7), (w.add_uint16, 700), (w.add_int16, -700),
                                 (w.add_uint32, 70000), (w.add_int32, -70000), (w.add_float32, 0.1),
                                 (w.add_uint64, 2 ** 40), (w.add_int64, -2 ** 40), (w.add_float64, 0.1),
                                 (w.add_bool, True), (w.add_string, "héllo 👋")]):
        fn(f"t.v{i}", v)
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strings", ["a", "", "ü"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("h", np.arange(8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = GGUFFile(path)
    assert ours.metadata["t.nested"] == [[1, 2], [3]]              # GGUFReader cannot decode this one
    theirs = gguf.GGUFReader(path)
    flat = {k: v for k, v in ours.metadata.items() if k != "t.nested"}
    assert flat == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.") and k != "t.nested"}
    assert [(t.name, t.data.tolist()) for t in ours.tensors] == [(t.name, t.data.tolist()) for t in theirs.tensors]
    same_parse(gguf_reader(path), theirs)


def same_parse(a, b):
    """Two GGUFReaders hold the same fields (every part's dtype and values) and tensors."""
    assert list(a.fields) == list(b.fields)
    for k, fa in a.fields.items():
        fb = b.fields[k]
        assert (fa.offset, fa.types, fa.data) == (fb.offset, fb.types, fb.data), k
        assert [(p.dtype, p.tolist()) for p in fa.parts] == [(p.dtype, p.tolist()) for p in fb.parts], k
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.data.dtype, t.data.tolist()) for t in a.tensors] == \
           [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.data.dtype, t.data.tolist()) for t in b.tensors]


def test_the_plain_view_reader_parses_as_gguf_reader(tmp_path):
    """tests/_model_util.gguf_reader (GGUFReader over a plain view of the map, the reference here and in the
    HF peer tests) parses a model file as GGUFReader does: its every value type is checked above."""
    path = write_tiny_gguf(tmp_path / "m.gguf", arch="llama", n_layers=2, quant={"ffn_gate": "Q8_0"})
    a, b = gguf_reader(path), gguf.GGUFReader(path)
    assert type(a.data) is np.ndarray and type(b.data) is np.memmap
    same_parse(a, b)



def _strings_file(tmp_path, items) -> tuple:
    path = str(tmp_path / "s.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("t.strings", items)
    w.add_string("t.after", "end")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, bytearray(open(path, "rb").read())


def test_a_string_array_is_read_whole_and_invalid_utf8_is_refused_as_before(tmp_path):
    """String arrays are cut out and decoded at once (reader._strings): every kind of item comes back as
    written, and an item that is not UTF-8 (0xFF, the join byte, or a stray continuation byte) is refused
    as the per-item read refuses it."""
    items = ["", "a", "héllo 👋", "\x00", " \n\t", "ĠĠ", "\udc80".encode("utf-8", "surrogatepass").decode("latin-1"), ""]
    path, data = _strings_file(tmp_path, items)
    f = GGUFFile(path)
    assert f.metadata["t.strings"] == items and f.metadata["t.after"] == "end"
    at = data.index(b"h\xc3\xa9llo")
    for bad in (0xFF, 0x80):
        broken = bytearray(data)
        broken[at] = bad
        open(path, "wb").write(broken)
        with pytest.raises(ValueError, match="t.strings.*utf-8"):
            GGUFFile(path)

def _damaged(tmp_path, change) -> str:
    good = write_tiny_gguf(tmp_path / "good.gguf")
    data = bytearray(open(good, "rb").read())
    change(data)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize("change,match", [
    (lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 9)), "version 9 is not supported"),
    (lambda d: d.__setitem__(slice(8, 16), struct.pack("<Q", 2 ** 60)), "counts past the end"),
    (lambda d: d.__setitem__(slice(16, 24), struct.pack("<Q", 2 ** 40)), "counts past the end"),
    (lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 2 ** 62)), "truncated at byte 32"),
    (lambda d: d.__delitem__(slice(200, None)), "counts past the end"),
    (lambda d: d.__delitem__(slice(2000, None)), "truncated at byte"),
    (lambda d: d.__delitem__(slice(len(d) - 100, None)), "ends at byte .* but the file has"),
])
def test_damage_is_refused_by_name(tmp_path, change, match):
    """A version, a count or a length past the file, a cut: ValueError naming it, never a huge allocation."""
    with pytest.raises(ValueError, match=match):
        GGUFFile(_damaged(tmp_path, change))
