"""`convert --scales ue8m0` (issue 28): power-of-two block scales for DeepGEMM on Hopper / Blackwell.

The reference here is written apart from fp8fix: exact values with Python fractions or float64, nearest
e4m3fn values by searching the sorted table of torch's own e4m3fn values (ties to the even code), and
vLLM 0.32's `requant_weight_ue8m0_inplace` rule as its torch code computes it (float32 product, amax
clamped to 1e-4, 2^ceil(log2(amax / 448)), divide, torch's cast).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8fix.numerics.ue8m0 import ue8m0_rows
from tests.builders import FORMATS, build, glm, llama, mimo_v2, phi3
from tests.conftest import run_cli, run_process
from tests.test_unquantized import tampered, tensors_of

#: torch's e4m3fn values of codes 0x00..0x7E, ascending: the grid a requantized value lands on.
GRID = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
FINITE = [c for c in range(256) if c & 0x7F != 0x7F]


def nearest(x: torch.Tensor) -> torch.Tensor:
    """x's nearest e4m3fn values (float64), ties to the even code, saturating at 448."""
    a = x.abs().clamp(max=448.0)
    hi = torch.searchsorted(GRID, a).clamp(1, len(GRID) - 1)
    lo = hi - 1
    below, above = a - GRID[lo], GRID[hi] - a
    pick_lo = (below < above) | ((below == above) & (lo % 2 == 0))
    return torch.where(pick_lo, GRID[lo], GRID[hi]) * torch.where(x < 0, -1.0, 1.0)


def smallest_holding(amax: float) -> Fraction:
    """The smallest power of two p with amax <= 448 p, exactly."""
    p, target = Fraction(1), Fraction(amax) / 448
    while p < target:
        p *= 2
    while p / 2 >= target:
        p /= 2
    return p


def reference(v: torch.Tensor, s: float) -> tuple[float, torch.Tensor]:
    """(the block's new scale, its new values in code units) by the rule: kept at a power-of-two scale; else
    the smaller squared error of p (smallest holding) and p / 2, ties to p."""
    if math.frexp(s)[0] == 0.5:
        return s, v / s
    amax = float(v.abs().max())
    if amax == 0:
        return 2.0 ** math.ceil(math.log2(s)), torch.zeros_like(v)
    p = float(smallest_holding(amax))
    options = {q: nearest(v / q) for q in (p, p / 2)}
    error = {q: float(((c * q - v) ** 2).sum()) for q, c in options.items()}
    q = p / 2 if error[p / 2] < error[p] else p
    return q, options[q]


def vllm_rule(codes: torch.Tensor, s: float) -> tuple[float, torch.Tensor]:
    """vLLM 0.32 (utils/deep_gemm.py per_block_cast_to_fp8 with use_ue8m0, from requant_weight_ue8m0_inplace)."""
    w_dq = codes.view(torch.float8_e4m3fn).to(torch.float32) * torch.tensor(s, dtype=torch.float32)
    amax = w_dq.abs().float().amax().clamp(1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2((amax / 448.0).abs())))
    return float(sf), (w_dq * (1.0 / sf)).to(torch.float8_e4m3fn).double()


def ours(codes: torch.Tensor, s: float) -> tuple[float, torch.Tensor]:
    row = ue8m0_rows(codes.numpy().tobytes(), "F8_E4M3", codes.shape[1], codes.shape[1], [s])
    new = torch.frombuffer(bytearray(row.codes), dtype=torch.uint8).reshape(codes.shape)
    return 2.0 ** row.exponents[0], new.view(torch.float8_e4m3fn).double()


@pytest.mark.parametrize(
    "s",
    [2.0**-9, 1.0, 2.0**-60, 2.0**60, 1.0000001, 0.99999994, 0.0013, 3.7e-30, 1.7e30, 448.0 / 3],
    ids=["pow2", "one", "tiny-pow2", "huge-pow2", "above", "below", "typical", "tiny", "huge", "third"],
)
def test_every_code_at_every_scale_class(s: float) -> None:
    """A block holding every finite code once, at scales of each class: the new scale and every new code as
    the exact rule says (kept byte for byte at a power of two)."""
    s = float(np.float32(s))
    codes = torch.tensor(FINITE, dtype=torch.uint8).reshape(2, 127)
    v = codes.view(torch.float8_e4m3fn).double() * s
    scale, new = ours(codes, s)
    want_scale, want = reference(v, s)
    assert scale == want_scale and torch.equal(new, want), s
    if math.frexp(s)[0] == 0.5:
        assert torch.equal(new, codes.view(torch.float8_e4m3fn).double())


def blocks(count: int, seed: int) -> list[tuple[torch.Tensor, float]]:
    """Random 32x32 blocks as exporters write them (normal values, scale = amax / 448), and real-shaped ones
    with an outlier column and tiny values (where half the power of two can win), and all-tiny ones
    (under vLLM's amax floor)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        w = torch.randn(32, 32, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen)) * 0.1
        if i % 3 == 1:
            w[:, 0] *= 50  # an outlier column
        if i % 3 == 2:
            w *= 1e-4  # a block of tiny values
        s = float(np.float32(float(w.abs().max()) / 448))
        codes = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        out.append((codes, s))
    return out


def test_never_worse_than_vllms_rule_and_better_on_average() -> None:
    """10k blocks: fp8fix's squared error against the exact values is at most vLLM's on every block."""
    ours_total = vllm_total = 0.0
    better = 0
    for codes, s in blocks(10_000, seed=1):
        v = codes.view(torch.float8_e4m3fn).double() * s
        scale, new = ours(codes, s)
        sf, theirs = vllm_rule(codes, s)
        mine = float(((new * scale - v) ** 2).sum())
        vllms = float(((theirs * sf - v) ** 2).sum())
        assert mine <= vllms, (s, mine, vllms)
        better += mine < vllms
        ours_total += mine
        vllm_total += vllms
    assert ours_total < vllm_total and better > 0, (ours_total, vllm_total, better)


def test_reported_vllm_figures_are_vllms(tmp_path: Path) -> None:
    """The per-block figures fp8fix reports for vLLM's load-time requantization match vLLM's rule run here."""
    for codes, s in blocks(300, seed=2):
        row = ue8m0_rows(codes.numpy().tobytes(), "F8_E4M3", 32, 32, [s])
        v = codes.view(torch.float8_e4m3fn).double() * s
        sf, theirs = vllm_rule(codes, s)
        values = codes.view(torch.float8_e4m3fn).double()
        _, exponent = torch.frexp(values.abs().clamp(min=2.0**-9))
        step = torch.exp2((exponent - 1).clamp(min=-6).double() - 3) * s
        steps = (theirs * sf - v).abs() / step
        assert math.isclose(row.stats.vllm_max_steps, float(steps.max()), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(row.stats.vllm_sum_sq_steps, float((steps**2).sum()), rel_tol=1e-9, abs_tol=1e-9)


BLOCK_FORMATS = ["block-fp8", "block-fp8-bf16", "block-fp8-e8m0", "ct-block"]
SHAPES = {"phi3": phi3, "llama": llama, "glm": glm}


def check_output(src: Path, out: Path, block: tuple[int, int]) -> int:
    """Every block of OUTPUT against the reference; returns the blocks checked."""
    source, output = tensors_of(src), tensors_of(out)
    checked = 0
    for name, w in source.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        scale_name = next(n for n in (name + "_scale_inv", name[:-6] + "weight_scale") if n in source)
        s_grid, o_grid = source[scale_name].double(), output[scale_name].double()
        assert output[scale_name].dtype == source[scale_name].dtype
        rows, cols = w.shape
        for r in range(s_grid.shape[0]):
            for c in range(s_grid.shape[1]):
                sl = (
                    slice(r * block[0], min(rows, (r + 1) * block[0])),
                    slice(c * block[1], min(cols, (c + 1) * block[1])),
                )
                s = float(s_grid[r, c])
                v = w[sl].double() * s
                scale, values = reference(v, s)
                assert float(o_grid[r, c]) == scale, (name, r, c)
                assert torch.equal(output[name][sl].double(), values), (name, r, c)
                checked += 1
    return checked


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_every_block_format_and_shape(tmp_path: Path, fmt: str, shape: str) -> None:
    src = build(tmp_path / "src", SHAPES[shape](), fmt=fmt, scale="block")
    result = run_cli("convert", src, tmp_path / "out", "--scales", "ue8m0", "--layout", "fused", "--verify", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    block = FORMATS[fmt].block
    assert block is not None
    checked = check_output(src, tmp_path / "out", block)
    modules = report["ue8m0"]["modules"]
    assert sum(m["blocks"] for m in modules) == checked
    assert sum(m["blocks_kept"] + m["blocks_requantized"] for m in modules) == checked
    if fmt == "block-fp8-e8m0":  # already powers of two: every block kept, codes byte for byte
        assert all(m["blocks_requantized"] == 0 for m in modules)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config.get("scale_fmt") == (None if fmt == "ct-block" else "ue8m0")
    assert all(m["max_steps"] <= m["vllm_max_steps"] + 1e-12 for m in modules)


def test_pre_sharded_chunks(tmp_path: Path) -> None:
    """MiMo-V2.5's chunks, each with its own block grid: the grid restarts per chunk, and verify agrees."""
    src = mimo_v2(tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", "--scales", "ue8m0", "--layout", "fused", "--verify")
    assert result.exit_code == 0, result.output
    output = tensors_of(tmp_path / "out")
    scales = [t for n, t in output.items() if n.endswith("weight_scale_inv")]
    assert scales and all(bool((torch.frexp(t.double())[0] == 0.5).all()) for t in scales)


def test_with_e4m3fnuz(tmp_path: Path) -> None:
    """--to e4m3fnuz on top: the same values, the relabelled codes, each scale twice (its exponent + 1)."""
    src = build(tmp_path / "src", llama(), fmt="block-fp8", scale="block")
    for name, extra in (("fn", []), ("fnuz", ["--to", "e4m3fnuz"])):
        result = run_cli("convert", src, tmp_path / name, "--scales", "ue8m0", "--verify", *extra)
        assert result.exit_code == 0, result.output
    fn, fnuz = tensors_of(tmp_path / "fn"), tensors_of(tmp_path / "fnuz")
    for name, t in fn.items():
        if name.endswith("_scale_inv"):
            assert torch.equal(fnuz[name], t * 2), name
        elif t.dtype == torch.float8_e4m3fn:
            assert torch.equal(fnuz[name].double() * 2, t.double()), name  # fnuz codes are worth half


def test_verify_catches_what_is_off(tmp_path: Path) -> None:

    src = build(tmp_path / "src", llama(), fmt="block-fp8", scale="block", files=1)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--scales", "ue8m0").exit_code == 0
    good = tensors_of(out)
    weight = "model.layers.0.self_attn.o_proj.weight"
    scale = weight + "_scale_inv"
    nudged = good[weight].view(torch.uint8).clone()
    nudged[0, 0] ^= 1
    cases = {
        "a scale doubled": ({**good, scale: good[scale] * 2}, "block row 0"),
        "a code off": ({**good, weight: nudged.view(torch.float8_e4m3fn)}, "row 0 column 0"),
    }
    for why, (tensors, message) in cases.items():
        bad = tampered(out, tmp_path / why.replace(" ", "-"), tensors)
        result = run_cli("verify", src, bad)
        assert result.exit_code == 1 and message in result.output, (why, result.output)
    # scale_fmt saying ue8m0 over scales that are not
    plain = tmp_path / "plain"
    assert run_cli("convert", src, plain, "--layout", "fused").exit_code == 0
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (plain / "config.json").write_text(json.dumps(config))
    result = run_cli("verify", src, plain)
    assert result.exit_code == 1 and "scale_fmt is 'ue8m0', but a block scale is not a power of two" in result.output


@pytest.mark.parametrize(
    "fmt,scale,extra,code,message",
    [
        ("fp8", "tensor", [], 3, "have no block scales"),
        ("block-fp8", "block", ["--to", "bf16"], 2, "drop --scales"),
        ("block-fp8", "block", ["--scales", "ue9m0"], 2, "Invalid value for '--scales'"),
    ],
)
def test_refusals(tmp_path: Path, fmt: str, scale: str, extra: list[str], code: int, message: str) -> None:
    src = build(tmp_path / "src", llama(), fmt=fmt, scale=scale)
    args = extra if "--scales" in extra else ["--scales", "ue8m0", *extra]
    result = run_cli("convert", src, tmp_path / "out", *args)
    assert result.exit_code == code and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_e4m3fnuz_sources_are_refused(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), fmt="block-fp8", scale="block")
    assert run_cli("convert", src, tmp_path / "fnuz", "--to", "e4m3fnuz").exit_code == 0
    result = run_cli("convert", tmp_path / "fnuz", tmp_path / "out", "--scales", "ue8m0")
    assert result.exit_code == 3 and "e4m3fnuz weights are ROCm's" in result.output, result.output


def test_a_hostile_huge_scale_gives_strict_json_and_no_warnings(tmp_path: Path) -> None:
    """A block scale of 1e38: fp8fix's powers of two hold it (2^127 fits F32), but vLLM's float32 product
    overflows, so its figures are infinite: printed as inf, null in JSON (strict JSON: no NaN / Infinity
    tokens), and numpy's overflow warnings do not leak onto stderr."""
    from safetensors.torch import load_file, save_file

    src = build(tmp_path / "src", llama(), fmt="block-fp8", scale="block")
    shard = sorted(src.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(k for k in sorted(tensors) if k.endswith("down_proj.weight_scale_inv"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = 1e38
    save_file(tensors, shard, metadata={"format": "pt"})
    result = run_process("convert", src, tmp_path / "out", "--scales", "ue8m0", "--verify", "--json")
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    report = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON token {c}"))
    module = name.removesuffix(".weight_scale_inv")
    figures = next(m for m in report["ue8m0"]["modules"] if m["module"] == module)
    assert figures["vllm_max_steps"] is None and figures["vllm_rms_steps"] is None
    assert 0 < figures["max_steps"] <= 1  # fp8fix's own requantization of that weight is finite and bounded
    # the block at 1e38 is written at 2^127 (the smallest power of two holding it: 1e38 x 448 / 448)
    written = load_file(next(p for p in (tmp_path / "out").glob("*.safetensors") if name in load_file(p)))
    assert written[name].view(-1)[0].item() in (2.0**127, 2.0**126)


# --- verify's own arithmetic, against the e4m3fn definition (issue 48's mutation sample) ---------------------------


def test_verifys_step_is_the_gap_to_the_next_e4m3fn_value() -> None:
    """The step verify measures rounding in, at each positive e4m3fn value: the distance to the next one up
    (from torch's table of the 126 finite positive codes), subnormals included."""
    from fp8fix.verification.ue8m0 import e4m3fn_steps

    values = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    gaps = np.diff(values)
    assert np.array_equal(e4m3fn_steps(values[:-1]), gaps)


@pytest.mark.parametrize("k", [-3, 0, 1, 4, 20])
def test_verifys_smallest_block_scale_holding_a_maximum(k: int) -> None:
    """The smallest power of two p with amax <= 448 p, by exact arithmetic, where float log2 rounds down: amax
    one ulp above 448 * 2^k needs 2^(k+1)."""
    from fp8fix.verification.ue8m0 import smallest_holding

    for amax in (448.0 * 2.0**k, math.nextafter(448.0 * 2.0**k, math.inf), 448.0 * 2.0**k * 0.75):
        p = Fraction(1, 2**40)
        while Fraction(amax) > 448 * p:
            p *= 2
        assert smallest_holding(amax) == p, amax
