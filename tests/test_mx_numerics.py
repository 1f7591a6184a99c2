"""MX blocks in BF16 (fp8fix/numerics/mx.py), against a decoder written here from the OCP Microscaling
Formats specification v1.0 (section 5.3 E8M0, 5.3.3 FP4 E2M1, 5.3.2 FP8 E4M3), not from fp8fix: every
(scale byte, code) pair of both element types, the nibble order, and the refusal of what BF16 cannot hold.
BF16 output bytes are read back with torch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fp8fix.numerics.mx import MX_BLOCK, MxRangeError, MxRows, mx_to_bf16


def spec_e8m0(byte: int) -> float:
    """OCP MX 5.3: 8 exponent bits, bias 127, no mantissa, no sign; 0xFF is NaN."""
    return math.nan if byte == 0xFF else 2.0 ** (byte - 127)


def spec_e4m3(code: int) -> float:
    """OCP 8-bit FP E4M3: bias 7, S.1111.111 NaN, no infinities, subnormals at exponent 0."""
    sign = -1.0 if code >> 7 else 1.0
    e, m = (code >> 3) & 0b1111, code & 0b111
    if e == 0b1111 and m == 0b111:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def spec_e2m1(nibble: int) -> float:
    """OCP MX 5.3.3: 1 sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if nibble >> 3 else 1.0
    e, m = (nibble >> 1) & 0b11, nibble & 0b1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def in_bf16_normal_range(value: float) -> bool:
    return value == 0 or (2.0**-126 <= abs(value) <= float(torch.finfo(torch.bfloat16).max))


def read_bf16(data: bytes) -> list[float]:
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).float().tolist()


@pytest.mark.parametrize(("element", "decode", "codes"), [("e4m3", spec_e4m3, 256), ("e2m1", spec_e2m1, 16)])
def test_every_scale_and_code_is_exact_or_refused(element: str, decode, codes: int) -> None:
    for scale in range(256):
        for code in range(codes):
            expected = decode(code) * spec_e8m0(scale)
            # one block of one row: the code repeated (E2M1: packed two per byte)
            data = bytes([code] * MX_BLOCK) if element == "e4m3" else bytes([code | code << 4] * (MX_BLOCK // 2))
            shape = MxRows(1, MX_BLOCK, element)
            if math.isnan(expected) or not in_bf16_normal_range(expected):
                with pytest.raises(MxRangeError):
                    mx_to_bf16(data, bytes([scale]), shape)
                continue
            assert read_bf16(mx_to_bf16(data, bytes([scale]), shape)) == [expected] * MX_BLOCK, (scale, code)


def test_nibbles_are_read_low_first_and_each_block_takes_its_own_scale() -> None:
    # one row of 64 E2M1 elements (two blocks): byte 0x72 holds 2 (1.0) then 7 (6.0)
    data = bytes([0x72] * 16 + [0xA1] * 16)  # 0xA1: 1 (0.5) then 0xA (-1.0)
    out = read_bf16(mx_to_bf16(data, bytes([127, 129]), MxRows(1, 64, "e2m1")))
    assert out[:4] == [1.0, 6.0, 1.0, 6.0]
    assert out[32:36] == [2.0, -4.0, 2.0, -4.0]  # times 2^2


def test_random_rows_match_the_spec_decoder() -> None:
    rng = random.Random(7)
    rows, cols = 5, 96
    for element, decode in (("e4m3", spec_e4m3), ("e2m1", spec_e2m1)):
        codes = [
            rng.choice([c for c in range(256 if element == "e4m3" else 16) if c & 0x7F != 0x7F])
            for _ in range(rows * cols)
        ]
        scales = [rng.randrange(100, 150) for _ in range(rows * cols // MX_BLOCK)]
        data = (
            bytes(codes) if element == "e4m3" else bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2))
        )
        out = read_bf16(mx_to_bf16(data, bytes(scales), MxRows(rows, cols, element)))
        expected = [decode(c) * spec_e8m0(scales[i // MX_BLOCK]) for i, c in enumerate(codes)]
        assert out == expected


def test_a_refusal_names_the_row_and_block() -> None:
    scales = bytes([127, 127, 127, 0xFF])  # row 1, block 1 is NaN
    with pytest.raises(MxRangeError, match="row 1, block 1") as caught:
        mx_to_bf16(bytes(2 * 64), scales, MxRows(2, 64, "e4m3"))
    assert caught.value.scale_byte == 0xFF


def test_sizes_that_do_not_match_are_refused() -> None:
    with pytest.raises(ValueError, match="do not make"):
        mx_to_bf16(bytes(64), bytes(1), MxRows(1, 64, "e4m3"))


def test_the_spec_decoders_agree_with_torch() -> None:
    """The decoders above against torch's own E8M0 and e4m3fn dtypes (a second reading of the specification)."""
    e8m0 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float().tolist()
    assert all(
        (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(e8m0, map(spec_e8m0, range(256)), strict=True)
    )
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert all(
        (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(e4m3, map(spec_e4m3, range(256)), strict=True)
    )
