"""Reading and validating safetensors headers, and encoding new ones.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON,
then a data buffer that the tensors tile exactly. fp8fix plans a whole conversion
from these headers, so it checks them as strictly as the safetensors readers do:
a file that a runtime would refuse is refused here, before anything is written.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fp8fix.errors import InvalidCheckpoint
from fp8fix.numerics.dtypes import ITEM_SIZE, decode_floats, tensor_nbytes

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
        return self.nbytes // ITEM_SIZE[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]  # in data-offset order


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate `path`'s header; raise `InvalidCheckpoint` naming the problem."""
    where = f"{path.name}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
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
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCheckpoint(f"{where}: header is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{where}: header is not a JSON object; the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidCheckpoint(f"{where}: __metadata__ must map strings to strings")
    buffer_start = 8 + header_len
    entries = [_parse_entry(where, path, name, entry, buffer_start) for name, entry in header.items()]
    entries.sort(key=lambda t: (t.start, t.end))
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


def _parse_entry(where: str, path: Path, name: str, entry: object, buffer_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ITEM_SIZE:
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise InvalidCheckpoint(f"{where}: tensor '{name}' has invalid data_offsets {offsets!r}")
    expected = tensor_nbytes(dtype, shape)
    if offsets[1] - offsets[0] != expected:
        raise InvalidCheckpoint(
            f"{where}: tensor '{name}' spans {offsets[1] - offsets[0]} bytes but {dtype} {shape} "
            f"needs {expected}; the file is corrupt"
        )
    return TensorInfo(name, path, dtype, tuple(shape), buffer_start + offsets[0], buffer_start + offsets[1])


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


def read_values(t: TensorInfo) -> list[float]:
    """A small float tensor's values (scales), read by absolute offset; big tensors are streamed instead."""
    fd = os.open(t.path, os.O_RDONLY)
    try:
        return decode_floats(os.pread(fd, t.end - t.start, t.start), t.dtype)
    finally:
        os.close(fd)
