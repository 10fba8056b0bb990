"""A GGUF container read in one pass: metadata as Python values, each tensor as a view of the file map.

gguf-py's ``GGUFReader`` builds one numpy view per array element while it parses, which is slow on a
large vocabulary (three such arrays). This reader decodes the same container sequentially with
``struct`` (measured: docs/perf/2026-12-01.md); tests/test_gguf_read.py checks it gives what GGUFReader
gives on both models (every metadata value, every tensor's name, type, shape, offset and bytes) and the same refusals on damaged
files. gguf-py still supplies the type tables (``GGML_QUANT_SIZES``, ``quant_shape_to_byte_shape``).

Layout (little-endian; llama.cpp's ggml/docs/gguf.md): magic ``GGUF``, version u32 (2 or 3), tensor
count u64, metadata count u64; metadata as (key string, value type u32, value); tensor infos as (name
string, n_dims u32, dims u64 each, type u32, offset u64); then, aligned to ``general.alignment`` (32 when
absent), the tensor data, each tensor at its offset. A string is a u64 length and UTF-8 bytes; an array
an element type u32, a count u64 and the elements.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

# value type -> struct format of a scalar (GGUFValueType: 8 STRING and 9 ARRAY are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
_SEPARATOR = 0xFF               # a byte no UTF-8 text holds: it joins a string array's items (_strings)
_ESCAPED = re.compile("[\udc80-\udcfe]")   # bytes surrogateescape kept: invalid UTF-8 in some item
MAX_ARRAY_ITEMS = 1 << 20   # a metadata array (the largest vocabularies hold 262,144 tokens): each item
#                             becomes a Python object (~40-80 bytes), so the count is bounded, not the bytes
_DIRECT = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
           "I32": np.int32, "I64": np.int64}      # tensor types GGUFReader views as values, not bytes


@dataclass
class Tensor:
    """One tensor as GGUFReader's ``ReaderTensor`` has it (the fields the loader reads)."""

    name: str
    tensor_type: object     # gguf.GGMLQuantizationType
    shape: np.ndarray       # the file's dims (ggml order: the fastest-varying first), uint64
    n_bytes: int
    data_offset: int
    data: np.ndarray        # a view of the file map: values for F16/F32/..., block bytes [.., row bytes] else


class GGUFFile:
    """Parse ``path``. ``metadata``: key -> int / float / bool / str / list (as ``ReaderField.contents``
    gives them); ``tensors``: list of :class:`Tensor`; ``data``: the read-only file map; ``header_size``: the
    bytes before the tensor data (header, metadata and tensor table).

    Raises ValueError naming what is wrong (truncated, bad magic or version, a count past the file, an
    array of more than ``MAX_ARRAY_ITEMS`` items (naming its key), a duplicated key or tensor name, an
    unknown type); the caller adds the path.
    """

    def __init__(self, path: str):
        import gguf

        from streamattn.runtime.files import open_regular
        open_regular(path).close()                # a FIFO or a device: refused by name, before the map
        self.data = np.memmap(path, mode="r", dtype=np.uint8)
        self._mv = memoryview(self.data)
        self._size = len(self._mv)
        self._off = 0
        if bytes(self._take(4)) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        # every entry takes at least 12 bytes: a count past the file is damage, not a huge allocation
        if n_tensors > self._size // 12 or n_kv > self._size // 12:
            raise ValueError(f"counts past the end of the file ({n_tensors} tensors, {n_kv} metadata keys)")
        self.metadata: dict = {}
        self.types: dict = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            vtype = self._scalar("<I")
            self.types[key] = vtype
            try:
                self.metadata[key] = self._value(vtype)
            except ValueError as e:
                raise ValueError(f"metadata key {key[:80]!r}: {e}") from None
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = np.array([self._scalar("<Q") for _ in range(n_dims)], dtype=np.uint64)
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = self.metadata.get("general.alignment", 32)
        if "general.alignment" in self.metadata and (self.types["general.alignment"] != _UINT32 or align < 1):
            raise ValueError("bad type or value for general.alignment")
        #: Bytes before the tensor data: the header, every metadata value and the tensor table.
        self.header_size = self._off
        start = -(-self._off // align) * align
        self.tensors = []
        names = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"duplicated tensor name {name!r}")
            names.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims.astype(object))) if len(dims) else 1
            n_bytes = n_elems * type_size // block
            at = start + int(offset)
            if at + n_bytes > self._size:
                raise ValueError(f"tensor {name!r} ends at byte {at + n_bytes} but the file has {self._size} "
                                 "bytes (truncated)")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            if qtype.name in _DIRECT:
                data = self.data[at:at + n_bytes].view(_DIRECT[qtype.name]).reshape(np_dims)
            else:
                data = self.data[at:at + n_bytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(Tensor(name, qtype, dims, n_bytes, at, data))
        del self._mv

    # -- cursor ------------------------------------------------------------------------------------------
    def _take(self, n: int):
        if n < 0 or self._off + n > self._size:
            raise ValueError(f"truncated at byte {self._off} (needs {n} more)")
        a = self._off
        self._off += n
        return self._mv[a:self._off]

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return str(self._take(self._scalar("<Q")), "utf-8")

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self._off}")
        etype, count = self._scalar("<I"), self._scalar("<Q")
        if count > MAX_ARRAY_ITEMS:
            raise ValueError(f"array of {count} values, more than the {MAX_ARRAY_ITEMS} this reader accepts")
        if etype in _NUMPY:
            size = np.dtype(_NUMPY[etype]).itemsize
            if count > self._size:
                raise ValueError(f"array of {count} values past the end of the file")
            return np.frombuffer(self._take(count * size), dtype=_NUMPY[etype]).tolist()
        if count > (self._size - self._off) // 8:   # each element takes >= 8 bytes (a length or a count)
            raise ValueError(f"array of {count} values past the end of the file")
        if etype == _STRING:
            return self._strings(count)
        return [self._value(etype) for _ in range(count)]   # arrays of arrays, as nested lists

    def _strings(self, count: int) -> list:
        """``count`` strings, as ``[self._string() for _ in range(count)]`` gives them (the same values and
        refusals), faster on a large vocabulary: one tight loop walks the length fields, numpy cuts
        every item out of the map at once, joined by a byte (0xFF) that UTF-8 never holds, and the whole is
        decoded and split in two C calls. An item that is not UTF-8 sends the array to the per-item read,
        which raises as it always did."""
        at, size, mv, unpack = self._off, self._size, self._mv, _U64.unpack_from
        heads = [0] * count                       # where each item's length field starts
        end = at
        for i in range(count):
            if end + 8 > size:
                raise ValueError(f"truncated at byte {end} (needs 8 more)")
            heads[i] = end
            end += 8 + unpack(mv, end)[0]
        if end > size:
            raise ValueError(f"truncated at byte {heads[-1] + 8} (needs {end - heads[-1] - 8} more)")
        if not count:
            return []
        region = np.array(self.data[at:end])                          # [bytes of the array]
        h = np.array(heads, np.int64) - at                            # [count]
        keep = np.ones(len(region), bool)
        keep[(h[:, None] + np.arange(8)).ravel()] = False             # drop every length field ...
        region[h[1:]] = _SEPARATOR                                    # ... but its first byte, the separator
        keep[h[1:]] = True
        text = region[keep].tobytes().decode("utf-8", "surrogateescape")
        if text.count("\udcff") != count - 1 or _ESCAPED.search(text):
            return [self._string() for _ in range(count)]             # not UTF-8: the per-item read raises
        self._off = end
        return text.split("\udcff")
