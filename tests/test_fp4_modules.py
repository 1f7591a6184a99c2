"""FP4 modules (issue 49): compressed-tensors NVFP4 (`nvfp4-pack-quantized`) and MXFP4 (`mxfp4-pack-quantized`),
alone or beside FP8 groups under `format: mixed-precision`, built as llm-compressor writes them
(`tests.builders.fp4_compressed_tensors`: compressed-tensors' presets, its packing, its global scale).

fp8fix reads them (inspect describes every FP4 module and judges no loader row: what the loaders do with FP4 is
not measured yet), writes them unquantized (`--to bf16` / `float16`), and passes them through FP8 conversions of
the FP8 parts beside them (tests/test_fp4_pass_through.py). The
values OUTPUT must hold are worked out here from SOURCE's bytes with a decoder of this file's own, from the OCP
MX specification's E2M1 table and torch's e4m3fn: MXFP4 exactly e2m1 x 2^(b - 127), NVFP4 e2m1 x scale / global
scale rounded once (within half a BF16 step of the exact quotient)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp8fix.io.checkpoint import open_checkpoint
from fp8fix.model import describe_checkpoint
from fp8fix.numerics.nvfp4 import nvfp4_table
from fp8fix.registry.architectures import Registry
from fp8fix.verdicts import loader_verdicts
from tests.builders import fp4_compressed_tensors, llama, phi3
from tests.conftest import load_tensors, run_cli

#: the OCP MX v1.0 E2M1 table (section 5.3.3), by nibble: bit 3 the sign
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1 = E2M1 + [-v for v in E2M1]

MIXED = {
    "self_attn.q_proj": "fp8",
    "self_attn.k_proj": "fp8",
    "self_attn.v_proj": "fp8",
    "self_attn.o_proj": "fp8",
    "mlp.gate_proj": "nvfp4",
    "mlp.up_proj": "nvfp4",
    "mlp.down_proj": "mxfp4",
}


def fp4_values(tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """float64 [out, in]: each element's exact value (NVFP4's quotient as float64: one rounding, 2^-53)."""
    packed = tensors[f"{module}.weight_packed"]
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    values = torch.tensor(E2M1, dtype=torch.float64)[nibbles]
    scale = tensors[f"{module}.weight_scale"]
    if scale.dtype == torch.uint8:  # MXFP4: E8M0 bytes
        per = torch.pow(torch.tensor(2.0, dtype=torch.float64), scale.double() - 127)
        return values * per.repeat_interleave(32, dim=1)
    per = scale.to(torch.float64) / tensors[f"{module}.weight_global_scale"].double()
    return values * per.repeat_interleave(16, dim=1)


def half_step_of(exact: torch.Tensor) -> torch.Tensor:
    """Half a BF16 step at each value (8 significant bits)."""
    _, exponent = torch.frexp(exact)
    return torch.ldexp(torch.tensor(0.5, dtype=torch.float64), exponent.double() - 8)


def assert_bf16_of(got: torch.Tensor, exact: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    error = (got.double() - exact).abs()
    assert bool((error <= half_step_of(exact)).all()), float((error / half_step_of(exact)).max())


def test_inspect_describes_the_fp4_modules_and_judges_no_row(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "mixed", MIXED)
    report = json.loads(run_cli("inspect", src, "--json").output)
    assert "mixed-precision" in report["format_label"] and "nvfp4-pack-quantized" in report["format_label"]
    schemes = {m["module"]: m["scheme"] for m in report["fp4_modules"]}
    assert schemes == {
        f"model.layers.{i}.{suffix}": scheme for i in range(2) for suffix, scheme in MIXED.items() if scheme != "fp8"
    }
    down = next(m for m in report["fp4_modules"] if m["module"] == "model.layers.0.mlp.down_proj")
    assert down["shape"] == [64, 128] and down["scale_shape"] == [64, 4] and not down["global_scale"]
    assert {m["module"] for m in report["modules"]} == {
        f"model.layers.{i}.{s}" for i in range(2) for s, scheme in MIXED.items() if scheme == "fp8"
    }
    rows = {row: v["verdict"] for row, v in report["loaders"].items()}
    assert rows.pop("SGLang 0.5.23") == "fails" and rows.pop("transformers") == "loads"  # (MXFP4: SGLang has none)
    assert set(rows.values()) == {"not-judged"}  # vLLM: GPU kernels, not run here
    assert report["convert_supported"]
    # the gate and the rows say the same: the rows vLLM's and transformers' target does not judge are a finding,
    # whose fix is the one conversion of FP4 modules, and --strict fails on it
    gate = [f for f in report["findings"] if f["code"] == "row-not-judged"]
    assert gate and gate[0]["fix"] == "--to bf16" and "transformers" not in gate[0]["loaders"]
    assert run_cli("inspect", src, "--strict").exit_code == 1
    assert run_cli("inspect", src, "--strict", "--target", "transformers").exit_code == 0
    text = run_cli("inspect", src).output
    assert "FP4 modules:  6" in text and "NVFP4" in text and "MXFP4" in text


@pytest.mark.parametrize("schemes", [MIXED, {"proj": "nvfp4"}, {"proj": "mxfp4"}], ids=["mixed", "nvfp4", "mxfp4"])
def test_to_bf16_writes_every_fp4_value(tmp_path: Path, schemes: dict[str, str]) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", schemes, files=3)  # scales mostly apart from their weights
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--to", "bf16", "--json")  # (run_cli verifies the output too)
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(out)
    fp4 = {n.removesuffix(".weight_packed") for n in before if n.endswith(".weight_packed")}
    assert fp4
    for module in fp4:
        exact = fp4_values(before, module)
        got = after[f"{module}.weight"]
        if before[f"{module}.weight_scale"].dtype == torch.uint8:
            assert torch.equal(got.double(), exact)  # MXFP4: exact in BF16
        else:
            assert_bf16_of(got, exact)
    for name, t in before.items():
        module = name.rpartition(".")[0]
        if t.dtype == torch.float8_e4m3fn and name.endswith(".weight") and module not in fp4:  # the FP8 modules
            assert_bf16_of(after[name], t.double() * before[f"{module}.weight_scale"].double())
        elif module not in fp4 and not name.endswith("weight_scale"):
            assert torch.equal(after[name], t), name  # everything else as it was
    assert not [n for n in after if "scale" in n or n.endswith("_packed")]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    plan = json.loads(result.stdout)
    written = {m["module"]: m["scheme"] for m in plan["dequantized"]}
    assert {m for m, s in written.items() if s != "fp8"} == fp4
    assert {row["verdict"] for row in plan["loaders"].values()} == {"loads"}


def test_float16_rounds_nvfp4_once(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"mlp.up_proj": "nvfp4"})
    assert run_cli("convert", src, tmp_path / "out", "--to", "float16").exit_code == 0
    before, after = load_tensors(src), load_tensors(tmp_path / "out")
    exact = fp4_values(before, "model.layers.1.mlp.up_proj")
    got = after["model.layers.1.mlp.up_proj.weight"]
    assert got.dtype == torch.float16
    _, exponent = torch.frexp(exact)
    half_step = torch.ldexp(torch.tensor(0.5, dtype=torch.float64), torch.clamp(exponent, min=-13).double() - 11)
    assert bool(((got.double() - exact).abs() <= half_step).all())


def test_verify_catches_a_wrong_fp4_value(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"mlp.gate_proj": "nvfp4", "mlp.down_proj": "mxfp4"})
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "bf16").exit_code == 0
    for module in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj"):
        tensors = load_tensors(out)
        original = tensors[f"{module}.weight"].clone()
        nonzero = int(torch.nonzero(original.flatten())[0])
        tensors[f"{module}.weight"].view(-1)[nonzero] *= 2  # one value, one power of two off
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        checked = run_cli("verify", src, out)
        assert checked.exit_code != 0 and module in checked.output, checked.output
        tensors[f"{module}.weight"] = original
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert run_cli("verify", src, out).exit_code == 0


@pytest.mark.parametrize("options", [[], ["--layout", "unfused"], ["--tp", "2"]])
def test_fp8_conversions_of_fp4_only_checkpoints_are_refused_and_write_nothing(
    tmp_path: Path, options: list[str]
) -> None:
    """Nothing FP8 to convert: an FP4-only checkpoint is written unquantized (or MXFP4 re-blocked), not copied
    under the name of a conversion (mixed checkpoints: tests/test_fp4_pass_through.py)."""
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "nvfp4"}, phi3() if "--layout" in options else None)
    result = run_cli("convert", src, tmp_path / "out", *options)
    assert result.exit_code == 3, result.output
    assert "FP4 module" in result.output and "--to bf16" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _rewrite(src: Path, change: dict[str, torch.Tensor | None]) -> None:
    tensors = load_tensors(src)
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage, said",
    [
        ("no global scale", "has no 'weight_global_scale'"),
        ("scale shape", "has shape [128, 2]"),
        ("scheme", "declares no mxfp4 config group"),
        ("odd width", "not whole groups of 16"),
    ],
)
def test_a_damaged_fp4_module_is_named_and_nothing_is_written(tmp_path: Path, damage: str, said: str) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"mlp.up_proj": "nvfp4"})
    module = "model.layers.0.mlp.up_proj"
    tensors = load_tensors(src)
    if damage == "no global scale":
        _rewrite(src, {f"{module}.weight_global_scale": None})
    elif damage == "scale shape":
        _rewrite(src, {f"{module}.weight_scale": tensors[f"{module}.weight_scale"][:, :2].contiguous()})
    elif damage == "scheme":  # MXFP4 tensors under a config that declares NVFP4 only
        scale = torch.full((128, 2), 120, dtype=torch.uint8)
        _rewrite(src, {f"{module}.weight_scale": scale, f"{module}.weight_global_scale": None})
    else:
        packed, scale = tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_scale"]
        _rewrite(
            src,
            {
                f"{module}.weight_packed": packed[:, :20].contiguous(),
                f"{module}.weight_scale": scale[:, :2].contiguous(),
            },
        )
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code in (2, 3) and module in result.output and said in result.output, result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    report = json.loads(run_cli("inspect", src, "--json").output)
    assert not report["convert_supported"]
    assert any(said in str(m["problem"]) for m in report["fp4_modules"])


def test_a_nan_scale_is_refused_naming_the_group(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"mlp.up_proj": "nvfp4"})
    module = "model.layers.1.mlp.up_proj"
    scale = load_tensors(src)[f"{module}.weight_scale"].clone()
    scale.view(torch.uint8)[5, 3] = 0x7F  # e4m3fn NaN
    _rewrite(src, {f"{module}.weight_scale": scale})
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code != 0 and "row 5, group 3" in result.output and module in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_unsupported_fp4_groups_are_not_read(tmp_path: Path) -> None:
    """A scheme compressed-tensors' presets do not write (NVFP4 in groups of 32) is a format not read yet."""
    src = fp4_compressed_tensors(tmp_path / "src", {"mlp.up_proj": "nvfp4"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and "not supported yet" in result.output
    rows = json.loads(run_cli("inspect", src, "--json").output)["loaders"]
    assert {row["verdict"] for row in rows.values()} == {"not-judged"}


def _rows(src: Path) -> dict[str, str]:
    report = json.loads(run_cli("inspect", src, "--json").output)
    return {row: v["verdict"] for row, v in report["loaders"].items()}


def test_global_scales_that_differ_across_packed_projections_are_judged(tmp_path: Path) -> None:
    """vLLM divides q / k / v (gate / up) by the largest of their NVFP4 global scales: wrong weights (cited from its
    source); SGLang refuses them. Shared global scales (llm-compressor's) are judged as any NVFP4 module."""
    shared = _rows(fp4_compressed_tensors(tmp_path / "shared", {"proj": "nvfp4"}))
    own = _rows(fp4_compressed_tensors(tmp_path / "own", {"proj": "nvfp4"}, shared_global=False))
    vllm = ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32")
    assert {shared[r] for r in vllm} == {"not-judged"} and {own[r] for r in vllm} == {"loads-wrong"}
    assert (shared["SGLang 0.5.23"], own["SGLang 0.5.23"]) == ("not-judged", "fails")
    assert shared["transformers"] == own["transformers"] == "loads"
    # headers only (as from the Hub): the global scales are not read, and SGLang's row is not judged
    ckpt = open_checkpoint(tmp_path / "own")
    ckpt.has_data = False
    rows = loader_verdicts(describe_checkpoint(ckpt, Registry.builtin()))
    assert rows["SGLang 0.5.23"].verdict == "not-judged" and "not read" in rows["SGLang 0.5.23"].reason
    assert {rows[r].verdict for r in vllm} == {"not-judged"}


def test_mxfp4_fails_in_sglang_and_unlike_checkpoints_are_not_judged(tmp_path: Path) -> None:
    assert _rows(fp4_compressed_tensors(tmp_path / "mx", {"proj": "mxfp4"}))["SGLang 0.5.23"] == "fails"
    # a packed q / k / v of two schemes (FP8 q, NVFP4 k / v) was not run: no row is judged
    odd = fp4_compressed_tensors(tmp_path / "odd", {"q_proj": "fp8", "k_proj": "nvfp4", "v_proj": "nvfp4"})
    assert set(_rows(odd).values()) == {"not-judged"}


def _bf16_nearest_even(v: Fraction) -> float:
    """`v` rounded to BF16 (8 significant bits) to nearest, ties to even, exactly (v normal and positive)."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    ulp = Fraction(2) ** (e - 7)
    n, rest = divmod(v, ulp)
    if rest > ulp / 2 or (rest == ulp / 2 and n % 2):
        n += 1
    return float(n * ulp)


@pytest.mark.parametrize("global_scale", [2688.0 / 0.37, 7.0, 448.0 * 6.0 / 3.1e-3])
def test_nvfp4_values_are_rounded_once(global_scale: float) -> None:
    """Every (e4m3 scale, E2M1) pair of the decode table is the exact e2m1 x scale / global scale rounded once to
    BF16, worked out in rationals here (the float64 quotient the table starts from rounds too: it must not show)."""
    g = Fraction(float(torch.tensor(global_scale, dtype=torch.float32)))
    table = nvfp4_table(float(g), "BF16")
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    pairs = table.pairs.reshape(256, 256)
    checked = 0
    for byte in range(256):
        s = float(scales[byte])
        if not math.isfinite(s) or table.unsafe[byte]:
            continue
        for nibble in range(16):
            v = Fraction(E2M1[nibble]) * Fraction(s) / g
            want = 0.0 if v == 0 else math.copysign(_bf16_nearest_even(abs(v)), float(v))
            bits = int(pairs[byte, nibble]) & 0xFFFF  # the pair whose high nibble is 0: its low half
            got = float(torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16))
            assert got == want or (want == 0 and got == 0), (byte, nibble, got, want)
            checked += 1
    assert checked > 3000


WHOLE = {"hidden": 256, "heads": 2, "kv_heads": 1, "intermediate": 256, "layers": 1}


def test_mxfp4_as_128_blocks_keeps_every_value_where_a_block_spans_little(tmp_path: Path) -> None:
    """`--blocks 128x128` of MXFP4 (for Hopper / MI300, no FP4): each module an e4m3fn `weight` at one power of two
    per 128 x 128 block, F32 `weight_scale` grid. Every E2M1 value is an e4m3fn value, so a block whose E8M0 bytes
    span few powers of two keeps every value: OUTPUT's code x scale equals SOURCE's e2m1 x 2^(b - 127) exactly."""
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "mxfp4"}, llama(**WHOLE))
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--blocks", "128x128", "--json")  # (run_cli verifies the output too)
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(out)
    modules = [n.removesuffix(".weight_packed") for n in before if n.endswith(".weight_packed")]
    for module in modules:
        w, grid = after[f"{module}.weight"], after[f"{module}.weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and grid.dtype == torch.float32
        assert grid.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        expanded = grid.double().repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        assert torch.equal(w.double() * expanded, fp4_values(before, module)), module
    assert not [n for n in after if n.endswith("_packed")]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized"
    assert {g["weights"]["strategy"] for g in qc["config_groups"].values()} == {"block"}
    plan = json.loads(result.stdout)
    assert {m["blocks_exact"] == m["blocks"] for m in plan["reblocked"]} == {True}
    assert len(plan["reblocked"]) == len(modules)


def test_mxfp4_blocks_spanning_14_powers_of_two_stay_exact(tmp_path: Path) -> None:
    """The bound docs/formats.md states: a block whose E8M0 bytes lie within 14 of its largest keeps every value."""
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "mxfp4"}, llama(**WHOLE))
    module = "model.layers.0.mlp.up_proj"
    scale = load_tensors(src)[f"{module}.weight_scale"].clone()
    scale[0, 0] = scale[:128, :4].max() - 14
    _rewrite(src, {f"{module}.weight_scale": scale})
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "128x128", "--json")
    assert result.exit_code == 0, result.output
    assert {m["blocks_rounded"] for m in json.loads(result.stdout)["reblocked"]} == {0}


def test_mxfp4_blocks_spanning_many_powers_of_two_round_and_say_so(tmp_path: Path) -> None:
    """A block whose E8M0 bytes lie 20 powers of two apart: its smallest elements fall below e4m3fn's finest step at
    the block's scale and round (counted, at most half a step; verify checks each against the nearest even)."""
    src = fp4_compressed_tensors(tmp_path / "src", {"proj": "mxfp4"}, llama(**WHOLE))
    module = "model.layers.0.mlp.up_proj"
    scale = load_tensors(src)[f"{module}.weight_scale"].clone()
    scale[0, 0] -= 20
    _rewrite(src, {f"{module}.weight_scale": scale})
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "128x128", "--json")
    assert result.exit_code == 0, result.output
    rounded = {m["module"]: m for m in json.loads(result.stdout)["reblocked"]}[module]
    assert rounded["blocks_rounded"] == 1 and rounded["values_rounded"] > 0 and 0 < rounded["max_steps"] <= 0.5
    checked = json.loads(run_cli("verify", src, tmp_path / "out", "--json").stdout)
    record = next(w for w in checked["weights"] if w["tensor"] == f"{module}.weight_packed")
    assert record["kind"] == "requantized" and record["rounded_codes"] == rounded["values_rounded"]


@pytest.mark.parametrize(
    "schemes, said", [({"proj": "nvfp4"}, "not MX blocks"), (MIXED, "not re-blocked yet")], ids=["nvfp4", "fp8-beside"]
)
def test_blocks_128_refuses_what_is_not_mx(tmp_path: Path, schemes: dict[str, str], said: str) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", schemes, llama(**WHOLE))
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "128x128")
    assert result.exit_code == 3 and said in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("value", [0.0, float("nan"), -1.0, float("inf")])
def test_a_global_scale_no_value_comes_back_from_is_refused(tmp_path: Path, value: float) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", {"mlp.up_proj": "nvfp4"})
    name = "model.layers.1.mlp.up_proj.weight_global_scale"
    _rewrite(src, {name: torch.tensor([value], dtype=torch.float32)})
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and name in result.output and "finite and positive" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert not json.loads(run_cli("inspect", src, "--json").output)["convert_supported"]
