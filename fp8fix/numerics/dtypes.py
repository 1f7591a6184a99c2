"""safetensors dtype facts: element sizes, which dtypes are FP8, their special codes.

Pure data and byte-level helpers; no torch, so every path that only moves bytes
can use them.
"""

from __future__ import annotations

import math
import struct

from fp8fix.vocab import Encoding

#: Bytes per element of every whole-byte dtype string safetensors 0.8 knows.
ITEM_SIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: Bits per element of every dtype safetensors 0.8 accepts, sub-byte and complex ones included:
#: a file may hold them (copied as raw bytes); fp8fix computes only on whole-byte dtypes.
BITS: dict[str, int] = {**{d: 8 * n for d, n in ITEM_SIZE.items()}, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}

E4M3FN = "F8_E4M3"
E4M3FNUZ = "F8_E4M3FNUZ"
#: A bare power-of-two exponent byte, 2^(b - 127) (OCP MX's scale type; 255 is NaN).
E8M0 = "F8_E8M0"
E8M0_NAN = 0xFF

#: FP8 weight encodings fp8fix converts; the value is the encoding's common name.
FP8_WEIGHT_DTYPES: dict[str, Encoding] = {E4M3FN: "e4m3fn", E4M3FNUZ: "e4m3fnuz"}

#: The clamp used when requantizing into each encoding: vLLM's ROCm kernels clamp
#: e4m3fnuz to +-224, not 240, so fp8fix does the same.
REQUANT_CLAMP: dict[str, float] = {E4M3FN: 448.0, E4M3FNUZ: 224.0}

#: `--to` names -> dtype strings.
ENCODINGS: dict[Encoding, str] = {"e4m3fn": E4M3FN, "e4m3fnuz": E4M3FNUZ}

#: Codes that are NaN in each encoding and must never reach a rewritten weight.
NAN_CODES: dict[str, tuple[int, ...]] = {E4M3FN: (0x7F, 0xFF), E4M3FNUZ: (0x80,)}

#: Dtypes a scale may be stored in (F8_E8M0: a bare power-of-two exponent, for block scales).
SCALE_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E8M0")
#: Dtypes an activation (input) scale may be stored in: plain floats.
INPUT_SCALE_DTYPES = ("F32", "BF16", "F16", "F64")


def is_fp8(dtype: str) -> bool:
    """An FP8 value type; F8_E8M0 is excluded: it holds only exponents (block scales)."""
    return dtype.startswith("F8_") and dtype != "F8_E8M0"


#: Every FP8 value type safetensors knows (`is_fp8`), for a set lookup in loops over every tensor.
FP8_DTYPES = frozenset(d for d in BITS if is_fp8(d))


def tensor_nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    """Bytes of a tensor of `dtype` and `shape` (the size its header entry must span).

    A sub-byte tensor that does not end on a byte boundary is -1: safetensors refuses it,
    and no byte span can match.
    """
    bits = math.prod(shape) * BITS[dtype]
    return bits // 8 if bits % 8 == 0 else -1


_STRUCT = {"F32": "f", "F16": "e", "F64": "d"}


def decode_floats(data: bytes, dtype: str) -> list[float]:
    """Decode a few little-endian float values (scales) without torch.

    BF16 is the top half of an F32, so it is widened by padding two zero bytes.
    """
    if dtype == "F32":
        return list(struct.unpack(f"<{len(data) // 4}f", data))
    if dtype == "F16":
        return list(struct.unpack(f"<{len(data) // 2}e", data))
    if dtype == "F64":
        return list(struct.unpack(f"<{len(data) // 8}d", data))
    if dtype == "BF16":
        widened = b"".join(b"\x00\x00" + data[i : i + 2] for i in range(0, len(data), 2))
        return list(struct.unpack(f"<{len(data) // 2}f", widened))
    if dtype == E8M0:  # numpy: an MX grid has a byte per 32 weights (a Python loop took 0.3 us a byte)
        import numpy as np

        exponents = np.frombuffer(data, dtype=np.uint8)
        powers = np.ldexp(1.0, exponents.astype(np.int32) - 127)
        values: list[float] = np.where(exponents == E8M0_NAN, np.nan, powers).tolist()
        return values
    raise ValueError(f"not a float scale dtype: {dtype}")


def encode_floats(values: list[float], dtype: str) -> bytes:
    """The inverse of `decode_floats`; BF16 keeps the top half of each F32 (values must fit exactly)."""
    if dtype in _STRUCT:
        return struct.pack(f"<{len(values)}{_STRUCT[dtype]}", *values)
    if dtype == "BF16":
        wide = struct.pack(f"<{len(values)}f", *values)
        return b"".join(wide[i + 2 : i + 4] for i in range(0, len(wide), 4))
    if dtype == "F8_E8M0":
        exponents = [math.frexp(v)[1] - 1 + 127 if v > 0 and math.isfinite(v) else 0xFF for v in values]
        return bytes(min(max(e, 0), 0xFF) for e in exponents)
    raise ValueError(f"not a float scale dtype: {dtype}")
