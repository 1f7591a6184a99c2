"""Reading and validating safetensors headers, and encoding new ones.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON,
then a data buffer that the tensors tile exactly. fp8fix plans a whole conversion
from these headers, so it checks them as strictly as the safetensors readers do:
a file that a runtime would refuse is refused here, before anything is written.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint
from fp8fix.io.json_text import MAX_DEPTH, JsonRefused, depth, parse_json
from fp8fix.io.source_files import SourceFiles
from fp8fix.io.source_tree import open_regular
from fp8fix.numerics.dtypes import BITS, decode_floats, tensor_nbytes

#: The safetensors readers refuse headers larger than this.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]  # in data-offset order


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate `path`'s header; raise `InvalidCheckpoint` naming the problem."""
    where = f"{path.name}"
    try:
        f = os.fdopen(open_regular(path), "rb")
        with f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InvalidCheckpoint(f"{where}: file is {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise InvalidCheckpoint(
                    f"{where}: header length {header_len} exceeds the 100 MB safetensors limit (corrupt file?)"
                )
            if 8 + header_len > size:
                raise InvalidCheckpoint(
                    f"{where}: header length {header_len} runs past the end of the {size}-byte file "
                    "(truncated download?)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise InvalidCheckpoint(f"{where}: cannot read: {e.strerror or e}") from e
    try:
        header = parse_json(raw, strict=True, keyed=False, check_depth=False)
        if isinstance(header, dict) and _may_hold_duplicates(raw, header):
            header = parse_json(raw, strict=True, check_depth=False)  # exact, a third slower
    except JsonRefused as e:
        raise InvalidCheckpoint(f"{where}: header is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{where}: header is not a JSON object; the file is corrupt")
    if "__metadata__" in getattr(header, "duplicates", ()):
        raise InvalidCheckpoint(f"{where}: header holds __metadata__ twice; the file is corrupt")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidCheckpoint(f"{where}: __metadata__ must map strings to strings; the file is corrupt")
    buffer_start = 8 + header_len
    entries = [_parse_entry(where, path, name, entry, buffer_start) for name, entry in header.items()]
    entries.sort(key=attrgetter("start", "end"))
    expected = buffer_start
    for t in entries:
        if t.start != expected:
            kind = "overlaps the previous tensor" if t.start < expected else "leaves a gap before it"
            raise InvalidCheckpoint(
                f"{where}: tensor '{t.name}' starts at buffer offset {t.start - buffer_start}, "
                f"expected {expected - buffer_start}: it {kind}; the file is corrupt"
            )
        expected = t.end
    if expected != size:
        raise InvalidCheckpoint(
            f"{where}: the tensors end at byte {expected} but the file has {size} bytes "
            f"({'truncated' if size < expected else 'trailing data'}); re-download or re-export it"
        )
    return SafetensorsHeader(path, dict(metadata), {t.name: t for t in entries})


#: The fields of a tensor entry; safetensors ignores any other, but refuses these twice.
ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
FIELD_SET = frozenset(ENTRY_FIELDS)
_FIELD_KEYS = {f: re.compile(rf'"{f}"\s*:'.encode()) for f in (*ENTRY_FIELDS, "__metadata__")}


def _may_hold_duplicates(raw: bytes, header: dict[str, Any]) -> bool:
    """False when the key counts prove no duplicate __metadata__ and no tensor field given twice.

    Each field key appears once per tensor entry unless one is repeated (or the text has it
    elsewhere, in a name or an ignored field): any other count sends the header through the
    exact, slower parse that records duplicates.
    """
    entries = len(header) - ("__metadata__" in header)
    if len(_FIELD_KEYS["__metadata__"].findall(raw)) > 1:
        return True
    return any(len(_FIELD_KEYS[f].findall(raw)) != entries for f in ENTRY_FIELDS)


U64_MAX = 2**64 - 1


_INTS = {int}


def _u64s(values: object) -> bool:
    """A JSON list of unsigned integers as serde reads usize: no bool, no float (2.0, 1e3, -0), none past u64."""
    if type(values) is not list:
        return False
    return not values or (set(map(type, values)) == _INTS and 0 <= min(values) and max(values) <= U64_MAX)


def _parse_entry(where: str, path: Path, name: str, entry: object, buffer_start: int) -> TensorInfo:
    """One tensor's entry, checked by safetensors 0.8's own rules (tests/test_hostile_input.py compares
    with safe_open). Kept lean: a DeepSeek-sized checkpoint has ~90,000 entries."""
    if not isinstance(entry, dict):
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has no dtype/shape/data_offsets entry")
    if type(entry) is not dict:  # a KeyedObject: the header may hold a field twice
        twice = getattr(entry, "duplicates", None)
        if twice and twice & FIELD_SET:
            raise InvalidCheckpoint(
                f"{where}: tensor '{name}' gives {sorted(twice & FIELD_SET)[0]} twice; the file is corrupt"
            )
    if entry.keys() != FIELD_SET:  # a missing field, or ignored ones (which may nest, up to serde's limit)
        missing = [f for f in ENTRY_FIELDS if f not in entry]
        if missing:
            raise InvalidCheckpoint(f"{where}: tensor '{name}' has no {missing[0]}; the file is corrupt")
        for key, value in entry.items():  # the entry and the header are 2 levels
            if key not in FIELD_SET and isinstance(value, (dict, list)) and depth(value) + 2 > MAX_DEPTH:
                raise InvalidCheckpoint(f"{where}: tensor '{name}' nests more than {MAX_DEPTH} levels deep")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in BITS:
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has unknown dtype {_short(dtype)}")
    if not _u64s(shape):
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has invalid shape {_short(shape)}")
    if not _u64s(offsets) or len(offsets) != 2:
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has invalid data_offsets {_short(offsets)}")
    if offsets[0] > offsets[1]:
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has data_offsets {offsets} that end before they start")
    expected = tensor_nbytes(dtype, shape)
    if offsets[1] - offsets[0] != expected:
        needs = f"needs {expected}" if expected >= 0 else "does not end on a byte boundary"
        raise InvalidCheckpoint(
            f"{where}: tensor '{name}' spans {offsets[1] - offsets[0]} bytes but {dtype} {shape} "
            f"{needs}; the file is corrupt"
        )
    return TensorInfo(name, path, dtype, tuple(shape), buffer_start + offsets[0], buffer_start + offsets[1])


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def encode_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str], align: Callable[[int], int] | None = None
) -> bytes:
    """The complete header bytes (length prefix + JSON padded with spaces) for tensors laid out in order.

    `tensors` is (name, dtype, shape) in the order their data will follow the header.
    The JSON is padded to a multiple of 8, plus `align(header_size)` more bytes when
    given (a multiple of 8), so the writer can choose where the data starts.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in tensors:
        size = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    if align is not None:
        body += b" " * align(8 + len(body))
    return struct.pack("<Q", len(body)) + body


def read_values(t: TensorInfo, files: SourceFiles | None = None) -> list[float]:
    """A small float tensor's values (scales), read by absolute offset; big tensors are streamed instead.
    Pass `files` to read many through descriptors opened once (100k scales: one open per shard)."""
    if files is None:
        with SourceFiles() as own:
            return read_values(t, own)
    return decode_floats(files.read(t.path, t.start, t.end), t.dtype)
