"""Pure numerics, exhaustively over the 256 FP8 codes where possible."""

from __future__ import annotations

import struct

import pytest
import torch

from fp8fix.numerics.dtypes import NAN_CODES, decode_floats
from fp8fix.numerics.requantize import requantize
from tests.conftest import raw

ALL_CODES = bytes(range(256))
FINITE_FN = bytes(c for c in range(256) if c not in (0x7F, 0xFF))


def as_fn(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale,target", [(0.5, 1.0), (0.013, 0.0371), (1.0, 1.0), (2.0**-8, 2.0**-3)])
def test_requantize_matches_the_formula_on_every_code(scale: float, target: float) -> None:
    codes, error = requantize(FINITE_FN, "F8_E4M3", scale, target)
    s, t = torch.tensor(scale, dtype=torch.float32), torch.tensor(target, dtype=torch.float32)
    value = as_fn(FINITE_FN).float() * s
    expected = (value / t).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = as_fn(codes)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    diff = (got.float() * t - value).abs()
    assert error.max_abs == pytest.approx(float(diff.max()), rel=1e-6)
    assert error.max_steps <= 0.5


def _torch_requantize(codes: bytes, dtype: torch.dtype, scale: float, target: float, out: torch.dtype, limit: float):
    """What fp8fix computed with torch before the byte maps: float32 dequantize, divide, clamp, cast."""
    from fp8fix.numerics.fp8 import steps_at

    s, t = torch.tensor(scale, dtype=torch.float32), torch.tensor(target, dtype=torch.float32)
    value = torch.frombuffer(bytearray(codes), dtype=torch.uint8).view(dtype).float() * s
    exact = (value / t).clamp(-limit, limit)
    new = exact.to(out)
    error = (new.float() * t - value).abs()
    steps = (new.float() - exact).abs() / steps_at(exact, "F8_E4M3" if out == torch.float8_e4m3fn else "F8_E4M3FNUZ")
    return bytes(new.view(torch.uint8).numpy().tobytes()), float(error.max()), float(steps.max())


@pytest.mark.parametrize(
    "dtype,out,limit",
    [
        ("F8_E4M3", "F8_E4M3", 448.0),
        ("F8_E4M3FNUZ", "F8_E4M3FNUZ", 224.0),
    ],
)
def test_requantize_byte_maps_equal_torch_float32_on_every_code(dtype: str, out: str, limit: float) -> None:
    """The byte maps emulate float32 exactly: 400 random scale pairs (overflowing the clamp, reaching
    subnormals, negative zero included) give torch's codes byte for byte and its worst errors."""
    from fp8fix.numerics.fp8 import torch_dtype

    finite = bytes(c for c in range(256) if c not in NAN_CODES[dtype])
    gen = torch.Generator().manual_seed(12)
    for _ in range(400):
        scale, target = (2.0 ** (torch.rand(2, generator=gen) * 24 - 12)).tolist()
        codes, error = requantize(finite, dtype, scale, target, out)
        ref_codes, ref_abs, ref_steps = _torch_requantize(
            finite, torch_dtype(dtype), scale, target, torch_dtype(out), limit
        )
        assert codes == ref_codes, (scale, target)
        assert error.max_abs == pytest.approx(ref_abs, rel=1e-6, abs=1e-30)
        assert error.max_steps == pytest.approx(ref_steps, rel=1e-6, abs=1e-12)


def test_requantize_to_the_same_scale_is_the_identity() -> None:
    codes, error = requantize(FINITE_FN, "F8_E4M3", 0.25, 0.25)
    # -0 stays -0, every other code is itself
    assert codes == FINITE_FN
    assert error.max_abs == 0 and error.max_steps == 0


def test_requantize_rounds_half_to_even() -> None:
    # code 0x40 is 2.0; at scale 1.0625 it is worth 2.125, which at target 2 is 1.0625:
    # exactly between 1.0 and 1.125 (the step in [1, 2)), so it rounds to the even mantissa, 1.0
    assert as_fn(b"\x40").float().item() == 2.0
    codes, _ = requantize(bytes([0x40]), "F8_E4M3", 1.0625, 2.0)
    assert as_fn(codes).float().item() == 1.0


def test_nan_codes_agree_with_torch() -> None:
    # the table of NaN codes agrees with torch's own decoding of every code, in both encodings
    nan_fn = torch.isnan(as_fn(ALL_CODES).float())
    assert tuple(c for c in range(256) if nan_fn[c]) == NAN_CODES["F8_E4M3"] == (0x7F, 0xFF)
    fnuz = torch.frombuffer(bytearray(ALL_CODES), dtype=torch.uint8).view(torch.float8_e4m3fnuz)
    nan_fnuz = torch.isnan(fnuz.float())
    assert tuple(c for c in range(256) if nan_fnuz[c]) == NAN_CODES["F8_E4M3FNUZ"] == (0x80,)


@pytest.mark.parametrize(
    "dtype,torch_dtype", [("F32", torch.float32), ("BF16", torch.bfloat16), ("F16", torch.float16)]
)
def test_decode_floats_agrees_with_torch(dtype: str, torch_dtype: torch.dtype) -> None:
    values = torch.tensor([0.0123, 1.5, 3.0e-5, 448.0, 1e-7]).to(torch_dtype)
    data = raw(values)
    assert decode_floats(data, dtype) == [float(v) for v in values.float()]
    assert decode_floats(struct.pack("<d", 0.1), "F64") == [0.1]


@pytest.mark.parametrize(
    "dtype,torch_dtype", [("F8_E4M3", torch.float8_e4m3fn), ("F8_E4M3FNUZ", torch.float8_e4m3fnuz)]
)
@pytest.mark.parametrize("scale", [0.013, 2.0**-9, 3.1e-5, 7.0])
def test_dequantize_to_bf16_rounds_each_code_once(dtype: str, torch_dtype: torch.dtype, scale: float) -> None:
    """Every finite code times a scale, rounded once to the nearest BF16 (ties to even): within half a
    BF16 step of the exact float64 product, and what torch's own rounding of it gives."""
    from fp8fix.numerics.dequantize import dequantize_rows

    finite = bytes(c for c in range(256) if c not in NAN_CODES[dtype])
    s = struct.unpack("<f", struct.pack("<f", scale))[0]  # a float32 scale, as checkpoints store it
    out, stats = dequantize_rows(finite, dtype, len(finite), len(finite), (s,))
    got = torch.frombuffer(bytearray(out), dtype=torch.bfloat16).double()
    exact = torch.frombuffer(bytearray(finite), dtype=torch.uint8).view(torch_dtype).double() * s
    _, exponent = torch.frexp(exact)
    steps = (got - exact).abs() / torch.ldexp(torch.ones_like(exact), exponent - 8)
    assert steps.max() <= 0.5 and stats.max_steps == steps.max().item()
    # torch rounds through float32 first; for these scales that extra rounding changes no result
    assert torch.equal(got, exact.float().to(torch.bfloat16).double())


def test_dequantize_to_bf16_ties_go_to_even_and_tiny_values_are_refused() -> None:
    from fp8fix.numerics.dequantize import dequantize_rows

    one = bytes([0x38])  # 1.0 in e4m3fn
    for scale, expected in ((1 + 2**-8, 1.0), (1 + 3 * 2**-8, 1 + 2**-6)):  # exactly between two BF16 values
        out, _ = dequantize_rows(one, "F8_E4M3", 1, 1, (scale,))
        assert torch.frombuffer(bytearray(out), dtype=torch.bfloat16).item() == expected
    with pytest.raises(ValueError, match="BF16's normal range"):
        dequantize_rows(bytes([0x01]), "F8_E4M3", 1, 1, (2.0**-120,))  # 2^-9 x 2^-120: below BF16's normals


@pytest.mark.parametrize(
    "value,kept",
    [
        (2.0**-126, True),  # BF16's smallest normal (float32's exponent range), kept exactly
        (-(2.0**-126), True),
        ((2 - 2**-7) * 2.0**127, True),  # BF16's largest finite value
        (0.0, True),
        (2.0**-127, False),  # a BF16 subnormal: refused, not flushed
        (2.0**128, False),  # past float32's range: no BF16 holds it
        ((2 - 2**-9) * 2.0**127, False),  # rounds up past the largest BF16: to inf
    ],
)
def test_round_to_bf16_keeps_exactly_bf16s_normal_range(value: float, kept: bool) -> None:
    """The edges of `--tp-bf16`'s range check, from BF16's definition (8 exponent bits as float32, 7 stored
    mantissa bits): mutation testing found the boundaries untested (`<` vs `<=`, float32's max vs float64's)."""
    import numpy as np

    from fp8fix.numerics.dequantize import round_to_bf16

    exact = np.array([value], dtype=np.float64)
    if kept:
        assert round_to_bf16(exact).tolist() == [value]
        assert torch.tensor(value, dtype=torch.float64).to(torch.bfloat16).double().item() == value
    else:
        with pytest.raises(ValueError, match="^a dequantized value falls outside BF16's normal range$"):
            round_to_bf16(exact)


def test_dequantize_rows_reports_no_error_where_bf16_holds_every_value() -> None:
    """e4m3fn values have at most 4 significant bits and BF16 keeps 8: at a power-of-two scale every code
    dequantizes exactly, so the worst error reported is 0 (mutation testing: a wrong `initial` of the max
    went unnoticed), and the bytes are torch's own BF16 of the same values."""
    from fp8fix.numerics.dequantize import dequantize_rows

    codes = bytes(c for c in range(256) if c not in (0x7F, 0xFF))  # every e4m3fn code but NaN
    data, stats = dequantize_rows(codes, "F8_E4M3", len(codes), len(codes), (0.25,))
    assert (stats.max_abs, stats.max_steps) == (0.0, 0.0)
    expected = torch.frombuffer(bytearray(codes), dtype=torch.float8_e4m3fn).double() * 0.25
    assert data == raw(expected.to(torch.bfloat16))


# Gaps a random sample of numerics/' mutants found (docs/development.md): each test fails with its mutant.


def test_e8m0_scales_by_their_definition() -> None:
    """OCP MX E8M0: a byte b is 2^(b - 127), 0xFF is NaN; it holds scales, not weights."""
    import math

    from fp8fix.numerics.dtypes import encode_floats, is_fp8

    values = [2.0**e for e in (-127, -1, 0, 1, 127)]
    codes = bytes([0, 126, 127, 128, 254])
    assert encode_floats(values, "F8_E8M0") == codes
    assert decode_floats(codes, "F8_E8M0") == values
    assert math.isnan(decode_floats(b"\xff", "F8_E8M0")[0])
    assert not is_fp8("F8_E8M0") and is_fp8("F8_E4M3") and is_fp8("F8_E4M3FNUZ")


def test_scaling_a_scale_past_its_range_says_so() -> None:
    from fp8fix.numerics.recodings import scale_exactly

    assert scale_exactly(struct.pack("<f", 3.0), "F32", 2.0) == struct.pack("<f", 6.0)
    with pytest.raises(ValueError, match=r"^a F32 scale times 0\.5 is not exactly representable$"):
        scale_exactly(struct.pack("<f", 2.0**-149), "F32", 0.5)  # F32's smallest subnormal, halved
    with pytest.raises(ValueError, match=r"^a F32 scale times 2\.0 is not exactly representable$"):
        scale_exactly(struct.pack("<f", 3e38), "F32", 2.0)  # past F32's range (struct refuses to pack it)


def test_the_worst_requantization_error_counts_the_first_code() -> None:
    """The worst error among the codes held, wherever the worst one sits (a mutant skipped byte 0)."""
    from fp8fix.numerics.requantize import requantize_map

    table = requantize_map("F8_E4M3", 1.0, 3.0, "F8_E4M3")
    worst = max(range(256), key=lambda c: table.abs_error[c] if c not in NAN_CODES["F8_E4M3"] else -1.0)
    assert table.abs_error[worst] > 0 and table.abs_error[0] == 0.0
    assert table.worst(bytes([worst]) + bytes(10)).max_abs == table.abs_error[worst]
    assert table.worst(bytes(10)).max_abs == 0.0


def test_present_codes_are_the_distinct_bytes_for_every_length_and_code() -> None:
    """`present_codes` (marks byte pairs, issue 30) finds exactly the distinct bytes: every single code alone and
    at each position of short runs (odd and even lengths, the last byte on its own), and random data of many
    lengths against a plain set."""
    import random

    from fp8fix.numerics.requantize import present_codes

    for code in range(256):
        for length in (1, 2, 3, 4, 7):
            for at in range(length):
                data = bytearray([7]) * length
                data[at] = code
                assert present_codes(bytes(data)) == sorted(set(data)), (code, length, at)
    rng = random.Random(0)
    for length in [0, 1, 2, 3, 255, 256, 1001, 65_537]:
        alphabet = rng.sample(range(256), rng.randint(1, 40))
        data = bytes(rng.choice(alphabet) for _ in range(length))
        assert present_codes(data) == sorted(set(data))


def test_the_worst_requantization_error_is_the_worst_among_the_codes_held() -> None:
    """`RequantizeMap.worst` looks codes up worst first and stops at the first held (issue 30): it must equal
    the plain maximum over the distinct bytes, for data holding every code, few codes, only the rarest
    (the big ones, which it skips by the largest code of each sign), codes of one sign, and data where
    most codes it asks for are missing (it then marks every code at once)."""
    import random

    from fp8fix.numerics.requantize import requantize_map

    rng = random.Random(1)
    maps = [
        requantize_map("F8_E4M3", s, t, out)
        for s, t, out in [(1.0, 3.0, "F8_E4M3"), (0.001, 0.0013, "F8_E4M3"), (2.0, 0.7, "F8_E4M3FNUZ")]
    ]
    finite = [c for c in range(256) if c not in NAN_CODES["F8_E4M3"]]
    cases = [bytes(finite), b"", bytes(100), bytes([0x80]) * 3, bytes(c for c in finite if c >= 0x80)]
    cases += [bytes(c for c in finite if c < 0x80)]
    for _ in range(200):
        alphabet = rng.sample(finite, rng.choice([1, 2, 3, 8, 40, 200]))
        cases.append(bytes(rng.choice(alphabet) for _ in range(rng.choice([1, 2, 17, 500]))))
    for table in maps:  # the codes with the worst errors, each alone among zeros, at the start and the end
        for code in sorted(finite, key=lambda c: -table.abs_error[c])[:20]:
            cases += [bytes([code]) + bytes(300), bytes(300) + bytes([code])]
    for table in maps:
        for data in cases:
            held = set(data)
            got = table.worst(data)
            assert got.max_abs == max((table.abs_error[c] for c in held), default=0.0), (data[:20], len(data))
            assert got.max_steps == max((table.steps[c] for c in held), default=0.0), (data[:20], len(data))
            assert table.worst(bytearray(data)) == got
