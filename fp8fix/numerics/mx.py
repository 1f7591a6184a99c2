"""OCP Microscaling (MX) blocks: E8M0 scales, E2M1 (FP4) elements, and their values in BF16.

An MX block is 32 elements along the input dimension sharing one E8M0 scale byte b, worth 2^(b - 127)
(b = 255 is NaN; there is no zero and no sign). MXFP8's elements are e4m3fn codes; MXFP4's are E2M1
nibbles, two per byte, the lower nibble first (gpt-oss `*_blocks`, compressed-tensors `mxfp4-pack-quantized`,
DeepSeek-V4's experts: the element at even index in bits 0-3).

A code times a power of two only moves its exponent: every e4m3 value (4 significant bits) and every E2M1
value (2) is a BF16 value (8), so code x 2^(b - 127) is exact in BF16 unless it leaves BF16's normal range
(fp8fix keeps that range, as `numerics.dequantize` does). Which (scale byte, code) pairs leave it is known in
advance: one 65,536-entry table of BF16 bit patterns per element type, indexed by (b << 8) | code, turns a
block row into BF16 with two numpy passes and no float math; the pairs outside the range are marked, and a
chunk holding one is refused with the block named (`MxRangeError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from fp8fix.numerics.dequantize import LookupArrays
from fp8fix.numerics.dtypes import E4M3FN, E8M0_NAN, NAN_CODES
from fp8fix.numerics.fp8 import e4m3_value
from fp8fix.numerics.ue8m0 import encode_e4m3fn

#: The e4m3fn codes that are NaN (E2M1 has none).
NAN_E4M3 = NAN_CODES[E4M3FN]
#: Elements per MX block (OCP MX v1.0 section 5: k = 32 for every MX element type).
MX_BLOCK = 32
#: The E8M0 byte that is NaN (`E8M0_NAN`, 255); every other byte b is 2^(b - 127).
E8M0_BIAS = 127
#: E2M1's eight magnitudes, by the low three bits of a nibble (OCP MX v1.0 table 5: 1 exponent bias).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: BF16's normal range: what a dequantized value must lie in (`numerics.dequantize` refuses the rest too).
_BF16_MIN_NORMAL = 2.0**-126
_BF16_MAX = float.fromhex("0x1.fep127")
#: Marks a (scale, code) pair whose value leaves BF16's normal range, or is NaN: 0x7FC1 is a NaN payload no
#: rounding produces, so a lookup that returns it can be told from any real value.
OUT_OF_RANGE = 0x7FC1


def e8m0_value(byte: int) -> float:
    """2^(byte - 127); NaN for 255."""
    return math.nan if byte == E8M0_NAN else math.ldexp(1.0, byte - E8M0_BIAS)


def e2m1_value(nibble: int) -> float:
    """The value of one E2M1 nibble (bit 3 the sign)."""
    magnitude = E2M1_MAGNITUDES[nibble & 0x7]
    return -magnitude if nibble & 0x8 else magnitude


def element_value(element: str, code: int) -> float:
    """The value of one element code of an MX element type: `e4m3` (a byte) or `e2m1` (a nibble)."""
    return e4m3_value(code, E4M3FN) if element == "e4m3" else e2m1_value(code)


@cache
def element_values(element: str) -> Any:
    """float64[256]: the value of each code byte (a nibble type: of its low 4 bits; NaN codes NaN)."""
    import numpy as np

    codes = 256 if element == "e4m3" else 16
    return np.array([element_value(element, code % codes) for code in range(256)], dtype=np.float64)


@cache
def bf16_table(element: str) -> Any:
    """uint16[65536]: at (b << 8) | code, the BF16 bits of code x 2^(b - 127), or OUT_OF_RANGE where that is
    NaN or outside BF16's normal range."""
    import numpy as np

    exponents = np.arange(256) - E8M0_BIAS
    products = np.ldexp(element_values(element)[None, :], exponents[:, None])  # exact in float64
    magnitudes = np.abs(products)
    fits = np.isfinite(products) & ((magnitudes == 0) | ((magnitudes >= _BF16_MIN_NORMAL) & (magnitudes <= _BF16_MAX)))
    fits[E8M0_NAN, :] = False
    # BF16 values are float32 values: their bits are the top half of float32's (exact: no rounding here)
    bits = (np.where(fits, products, 0.0).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    return np.where(fits, bits, np.uint16(OUT_OF_RANGE)).astype("<u2").reshape(-1)


class MxRangeError(ValueError):
    """A block's scale byte makes one of its elements NaN or leave BF16's normal range."""

    def __init__(self, row: int, block: int, scale_byte: int) -> None:
        self.row, self.block, self.scale_byte = row, block, scale_byte
        if scale_byte == E8M0_NAN:
            self.why = "is NaN (E8M0 255)"
        else:
            self.why = f"2^{scale_byte - E8M0_BIAS} puts an element outside BF16's normal range (or its code is NaN)"
        super().__init__(f"row {row}, block {block}: the scale byte {scale_byte} {self.why}")


@dataclass(frozen=True)
class MxRows:
    """Rows of an MX tensor: `rows` x `cols` elements (cols a multiple of MX_BLOCK), `element` e4m3 or e2m1."""

    rows: int
    cols: int
    element: str

    @property
    def blocks(self) -> int:
        return self.cols // MX_BLOCK

    @property
    def code_bytes(self) -> int:
        """Bytes of the element codes: one per e4m3 element, one per two E2M1 elements."""
        per_row = self.cols if self.element == "e4m3" else self.cols // 2
        return self.rows * per_row


def element_codes(data: bytes | bytearray | memoryview, element: str) -> Any:
    """The element codes of packed MX data as uint8: e4m3 bytes as they are; E2M1 nibbles unpacked, the low
    nibble of each byte first."""
    import numpy as np

    packed = np.frombuffer(data, dtype=np.uint8)
    if element == "e4m3":
        return packed
    codes = np.empty(packed.size * 2, dtype=np.uint8)
    np.bitwise_and(packed, 0x0F, out=codes[0::2])
    np.right_shift(packed, 4, out=codes[1::2])
    return codes


def mx_values(data: bytes | bytearray | memoryview, scales: bytes | bytearray | memoryview, shape: MxRows) -> Any:
    """float64 [rows, cols]: each element exactly code x 2^(b - 127) (NaN where the code is); MxRangeError names
    the first block whose scale is NaN."""
    import numpy as np

    _check_sizes(data, scales, shape)
    codes = element_codes(data, shape.element).reshape(shape.rows, shape.blocks, MX_BLOCK)
    exponents = np.frombuffer(scales, dtype=np.uint8).reshape(shape.rows, shape.blocks, 1)
    if E8M0_NAN in scales:
        row, block, _ = (int(i[0]) for i in np.nonzero(exponents == E8M0_NAN))
        raise MxRangeError(row, block, E8M0_NAN)
    powers = np.ldexp(1.0, exponents.astype(np.int32) - E8M0_BIAS)
    values: Any = (element_values(shape.element)[codes] * powers).reshape(shape.rows, shape.cols)
    return values


def _check_sizes(data: bytes | bytearray | memoryview, scales: bytes | bytearray | memoryview, shape: MxRows) -> None:
    if len(data) != shape.code_bytes or len(scales) != shape.rows * shape.blocks:
        raise ValueError(
            f"{len(data)} code bytes and {len(scales)} scale bytes do not make {shape.rows} x {shape.cols} "
            f"{shape.element} elements in blocks of {MX_BLOCK}"
        )


@cache
def safe_scales(element: str) -> Any:
    """bool[256]: the scale bytes at which every code but the NaN ones is a BF16 normal value (or zero): e4m3
    10 - 246, e2m1 2 - 252. A window whose scales all are, and that holds no NaN code, needs no range check."""
    import numpy as np

    table = bf16_table(element).reshape(256, 256)
    finite = np.isfinite(element_values(element))
    return np.all((table != OUT_OF_RANGE) | ~finite[None, :], axis=1)


def mx_to_bf16(
    data: bytes | bytearray | memoryview,
    scales: bytes | bytearray | memoryview,
    shape: MxRows,
    arrays: LookupArrays | None = None,
) -> memoryview:
    """Rows of MX element codes and their E8M0 scale bytes ([rows, cols / 32], row-major) as little-endian
    BF16 bytes [rows, cols]: each value exactly code x 2^(b - 127). MxRangeError names the first block with an
    element it cannot hold (a NaN scale, a value outside BF16's normal range, or a NaN e4m3 code).

    The result is a view of `arrays`' output (kept from one window to the next: fresh arrays cost page faults,
    as `numerics.dequantize.LookupArrays` says), valid until their next use; of new arrays without them.
    `scripts/bench_bf16.py --mx` measures it beside the naive torch decode."""
    import numpy as np

    _check_sizes(data, scales, shape)
    if shape.element == "e2m1":
        return _e2m1_to_bf16(data, scales, shape, arrays or LookupArrays())
    codes = element_codes(data, shape.element).reshape(shape.rows, shape.blocks, MX_BLOCK)
    exponents = np.frombuffer(scales, dtype=np.uint8).reshape(shape.rows, shape.blocks, 1)
    index, out = (arrays or LookupArrays()).get(codes.size, np.uint16)
    index, out = index.reshape(codes.shape), out.reshape(codes.shape)
    np.bitwise_or(np.left_shift(exponents, 8, dtype=np.uint16), codes, out=index)
    table = bf16_table(shape.element)
    np.take(table, index, out=out, mode="clip")  # every index is inside the table by construction
    nan_codes = shape.element == "e4m3" and any(c in bytes(data) for c in NAN_E4M3)
    if nan_codes or not safe_scales(shape.element)[exponents].all():
        bad = out == OUT_OF_RANGE
        if bad.any():
            row, block, _ = (int(i[0]) for i in np.nonzero(bad))
            raise MxRangeError(row, block, int(exponents[row, block, 0]))
    return memoryview(out.reshape(-1)).cast("B")


@cache
def e2m1_e4m3_pairs() -> Any:
    """uint16[256]: the e4m3fn codes of a packed byte's two E2M1 elements, the lower nibble's in the low byte
    (little-endian: the first element first). Every E2M1 value is an e4m3fn value, so each code is exact."""
    import numpy as np

    codes = encode_e4m3fn(element_values("e2m1")[:16]).astype(np.uint16)  # (-0 as 0x80: the sign kept)
    nibbles = np.arange(256)
    return (codes[nibbles & 0x0F] | (codes[nibbles >> 4] << np.uint16(8))).astype("<u2")


def e2m1_as_e4m3(data: bytes | bytearray | memoryview) -> bytes:
    """Packed E2M1 elements (two a byte, the lower nibble first) as e4m3fn codes, one a byte, exactly."""
    import numpy as np

    return np.take(e2m1_e4m3_pairs(), np.frombuffer(data, dtype=np.uint8)).tobytes()


def nibble_pairs(bits: Any) -> Any:
    """uint32[65536] from uint16 bits [256 scale bytes, 16 nibbles]: at (scale byte << 8) | packed byte, both
    elements' bits, the lower nibble's in the low half (little-endian: the first element first). FP4 rows are looked
    up a packed byte at a time this way: its two elements share a block (`look_up_pairs`)."""
    import numpy as np

    wide = np.asarray(bits).astype(np.uint32)
    low, high = np.arange(256) & 0x0F, np.arange(256) >> 4
    return (wide[:, low] | (wide[:, high] << np.uint32(16))).astype("<u4").reshape(-1)


def look_up_pairs(packed: Any, scale_bytes: Any, pairs: Any, arrays: LookupArrays) -> Any:
    """Packed FP4 [rows, blocks, bytes] with a scale byte per block [rows, blocks, 1], through `nibble_pairs`: the
    uint32 pairs [rows, blocks, bytes], a view of `arrays`' output."""
    import numpy as np

    index, out = arrays.get(packed.size, np.uint16, np.uint32)
    index, out = index.reshape(packed.shape), out.reshape(packed.shape)
    np.bitwise_or(np.left_shift(scale_bytes, 8, dtype=np.uint16), packed, out=index)
    np.take(pairs, index, out=out, mode="clip")  # every index is inside the table by construction
    return out


def first_out_of_range(out: Any) -> tuple[int, int] | None:
    """The (row, block) of the first half of `look_up_pairs`' output marked OUT_OF_RANGE, or None."""
    import numpy as np

    bad = ((out & 0xFFFF) == OUT_OF_RANGE) | ((out >> 16) == OUT_OF_RANGE)
    if not bad.any():
        return None
    row, block, _ = (int(i[0]) for i in np.nonzero(bad))
    return row, block


@cache
def e2m1_pair_table() -> Any:
    """`nibble_pairs` of the BF16 bits of every E2M1 element at every 2^(b - 127) (OUT_OF_RANGE where none)."""
    return nibble_pairs(bf16_table("e2m1").reshape(256, 256)[:, :16])


def _e2m1_to_bf16(
    data: bytes | bytearray | memoryview, scales: bytes | bytearray | memoryview, shape: MxRows, arrays: LookupArrays
) -> memoryview:
    """MXFP4 rows as BF16, one lookup per packed byte (its two elements share a block: `e2m1_pair_table`)."""
    import numpy as np

    packed = np.frombuffer(data, dtype=np.uint8).reshape(shape.rows, shape.blocks, MX_BLOCK // 2)
    exponents = np.frombuffer(scales, dtype=np.uint8).reshape(shape.rows, shape.blocks, 1)
    out = look_up_pairs(packed, exponents, e2m1_pair_table(), arrays)
    bad = None if safe_scales("e2m1")[exponents].all() else first_out_of_range(out)
    if bad is not None:
        raise MxRangeError(*bad, int(exponents[bad[0], bad[1], 0]))
    return memoryview(out.reshape(-1)).cast("B")


def e8m0_row_bytes(exponents: list[int], rows: int, cols: int, block_cols: int) -> bytes:
    """The E8M0 scales [rows, cols / 32] of rows whose column block c (of `block_cols`, a multiple of 32) is at
    2^exponents[c]: each group of 32 gets its block's byte k + 127. ValueError where a power of two has no E8M0
    byte (below 2^-127 or above 2^127)."""
    import numpy as np

    e = np.asarray(exponents, dtype=np.int64) + E8M0_BIAS
    outside = (e < 0) | (e >= E8M0_NAN)
    if outside.any():
        c = int(np.argmax(outside))
        raise ValueError(f"column block {c} is at 2^{exponents[c]}, outside E8M0's 2^-127 .. 2^127")
    groups = np.arange(cols // MX_BLOCK) * MX_BLOCK // block_cols
    return np.tile(e.astype(np.uint8)[groups], rows).tobytes()
