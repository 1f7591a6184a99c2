"""compressed-tensors MXFP8 read as a format (issue 49): llm-compressor's checkpoints (tests/builders.py
mxfp8_compressed_tensors: e4m3fn weights, one E8M0 byte per 32 elements of a row as U8 `weight_scale`), of a Llama
and of a Phi-3 (qkv_proj / gate_up_proj fused on disk).

What is asserted, each from outside the code under test:
- the rows are what the real loaders were measured to do (tests/loaders/test_mx_formats.py), written out here:
  SGLang fails, transformers loads, every vLLM row is not judged (its CPU builds have no MXFP8 kernel); no FP8
  rule (block scales, fused modules) judges them; the findings, `--strict` and convert say the same;
- `convert --to bf16` writes each weight as exactly code x 2^(b - 127), decoded here from the OCP MX
  specification (tests/test_mx_numerics.py's decoders), and `--to float16` rounds that once;
- what fp8fix cannot write faithfully is refused, named, with nothing written: a NaN scale byte, a value BF16
  cannot hold, scales of the wrong shape or dtype, weights that are not whole blocks, other MX dialects.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.builders import build, llama, mxfp8_compressed_tensors, phi3
from tests.conftest import run_cli
from tests.test_mx_numerics import spec_e4m3, spec_e8m0

#: What the real loaders do with these checkpoints (tests/loaders/test_mx_formats.py, measured).
MEASURED = {
    "vLLM <= 0.5.0": "not-judged",  # not run
    "vLLM 0.5.1 - 0.18": "not-judged",  # not run
    "vLLM 0.19 - 0.20": "not-judged",  # 0.19.0 fails, 0.20.2 needs a GPU kernel
    "vLLM 0.21 - 0.31": "not-judged",  # a GPU kernel
    "vLLM >= 0.32": "not-judged",
    "vLLM >= 0.32 on ROCm": "not-judged",
    "SGLang 0.5.23": "fails",
    "transformers": "loads",
}
MODELS = {"llama": llama, "phi3": phi3}


def model_file(root: Path) -> Path:
    return root / "model.safetensors"


def spec_values(codes: torch.Tensor, exponents: torch.Tensor) -> list[list[float]]:
    """The OCP MX value of every element, from the spec decoders (float64 Python arithmetic)."""
    rows: list[list[float]] = []
    for code_row, scale_row in zip(codes.view(torch.uint8).tolist(), exponents.tolist(), strict=True):
        rows.append([spec_e4m3(c) * spec_e8m0(scale_row[i // 32]) for i, c in enumerate(code_row)])
    return rows


@pytest.mark.parametrize("name", MODELS)
def test_rows_are_the_measured_outcomes_and_every_answer_agrees(tmp_path: Path, name: str) -> None:
    src = mxfp8_compressed_tensors(tmp_path / name, MODELS[name]())
    report = json.loads(run_cli("inspect", src, "--json").output)
    assert {row: v["verdict"] for row, v in report["loaders"].items()} == MEASURED
    assert "MXFP8" in report["format_label"] and report["convert_supported"]
    assert {m["scale"] for m in report["modules"]} == {"block"}
    # no FP8 rule reads these scales: nothing about fused single scales, block splits or odd shapes
    codes = {f["code"] for f in report["findings"]}
    assert codes == {"row-not-judged"}, codes
    # the gate: the findings name every target row that does not load, and --strict fails on them
    gated = {row for f in report["findings"] for row in f["loaders"]}
    assert "vLLM >= 0.32" in gated and all(MEASURED[row] != "loads" for row in gated)
    strict = run_cli("inspect", src, "--strict")
    assert strict.exit_code == 1 and "row-not-judged" in strict.output
    # every finding's fix is a conversion convert makes
    fixes = {f["fix"] for f in report["findings"]}
    assert fixes == {"--to bf16"}


@pytest.mark.parametrize("name", MODELS)
def test_to_bf16_is_exactly_the_mx_value(tmp_path: Path, name: str) -> None:
    src = mxfp8_compressed_tensors(tmp_path / name, MODELS[name]())
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")  # verify runs on it too (run_cli)
    assert result.exit_code == 0, result.output
    source, out = load_file(model_file(src)), load_file(model_file(tmp_path / "out"))
    layers = [n.removesuffix(".weight_scale") for n in source if n.endswith(".weight_scale")]
    assert layers and not any(n.endswith("_scale") for n in out)
    for layer in layers:
        weight = out[f"{layer}.weight"]
        assert weight.dtype == torch.bfloat16
        expected = spec_values(source[f"{layer}.weight"], source[f"{layer}.weight_scale"])
        assert weight.double().tolist() == expected, layer  # BF16 holds every one exactly
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    for loader, row in json.loads(run_cli("inspect", tmp_path / "out", "--json").output)["loaders"].items():
        assert row["verdict"] == "loads", loader


def test_to_float16_rounds_each_value_once(tmp_path: Path) -> None:
    src = mxfp8_compressed_tensors(tmp_path / "mx")
    assert run_cli("convert", src, tmp_path / "out", "--to", "float16").exit_code == 0
    source, out = load_file(model_file(src)), load_file(model_file(tmp_path / "out"))
    layer = "model.layers.0.mlp.down_proj"
    expected = torch.tensor(spec_values(source[f"{layer}.weight"], source[f"{layer}.weight_scale"]))
    assert torch.equal(out[f"{layer}.weight"], expected.to(torch.float16))  # torch rounds to nearest even


def test_convert_without_to_bf16_says_what_it_can_do_and_writes_nothing(tmp_path: Path) -> None:
    src = mxfp8_compressed_tensors(tmp_path / "mx")
    for options in ((), ("--to", "e4m3fnuz"), ("--layout", "unfused"), ("--target", "vllm"), ("--tp", "2")):
        result = run_cli("convert", src, tmp_path / "out", *options)
        assert result.exit_code == 3, (options, result.output)
        assert "--to bf16" in result.output and "Traceback" not in result.output
        assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mx"]


def rewrite(src: Path, change) -> None:
    """The checkpoint's tensors changed by `change(tensors)`, written back (a damaged or hostile export)."""
    tensors = load_file(model_file(src))
    change(tensors)
    save_file(tensors, model_file(src))


SCALE = "model.layers.1.mlp.down_proj.weight_scale"  # [64, 128]: four blocks a row


@pytest.mark.parametrize(
    ("byte", "said"), [(255, "holds nan"), (0, "outside BF16's normal range"), (254, "outside BF16's")]
)
def test_a_scale_byte_bf16_cannot_hold_is_refused_with_its_block(tmp_path: Path, byte: int, said: str) -> None:
    src = mxfp8_compressed_tensors(tmp_path / "mx")

    def damage(tensors: dict[str, torch.Tensor]) -> None:
        weight = tensors[SCALE.replace("_scale", "")]
        weight.view(torch.uint8)[5, 70] = 0x7E if byte == 254 else 0x01  # 448 x 2^127 / 2^-9 x 2^-127
        tensors[SCALE][5, 2] = byte

    rewrite(src, damage)
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3, result.output
    where = f"'{SCALE.replace('_scale', '')}' row 5, block 2: byte {byte}" if byte != 255 else f"scale '{SCALE}'"
    assert where in result.output and said in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda t: t.__setitem__(SCALE, t[SCALE][:, :1].contiguous()), "has one scale per 32 elements of a row"),
        (lambda t: t.__setitem__(SCALE, t[SCALE].float()), "is F32; an MX scale is one E8M0 byte"),
        (lambda t: t.pop(SCALE), "has no scale"),
    ],
    ids=["shape", "dtype", "missing"],
)
def test_a_damaged_scale_is_named_and_not_judged(tmp_path: Path, change, said: str) -> None:
    src = mxfp8_compressed_tensors(tmp_path / "mx")
    rewrite(src, change)
    report = json.loads(run_cli("inspect", src, "--json").output)
    assert {v["verdict"] for v in report["loaders"].values()} == {"not-judged"}
    assert not report["convert_supported"]
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and said in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_weights_that_are_not_whole_blocks_are_refused(tmp_path: Path) -> None:
    src = mxfp8_compressed_tensors(tmp_path / "mx")
    name = SCALE.replace("_scale", "")

    def cut(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:, :48].contiguous()
        tensors[SCALE] = tensors[SCALE][:, :2].contiguous()

    rewrite(src, cut)
    result = run_cli("convert", src, tmp_path / "out", "--to", "bf16")
    assert result.exit_code == 3 and "not whole blocks of 32" in result.output, result.output


@pytest.mark.parametrize(
    ("key", "value"),
    [("group_size", 16), ("scale_dtype", None), ("scale_dtype", "torch.float8_e8m0fnu"), ("symmetric", False)],
)
def test_other_group_settings_are_not_read_as_mxfp8(tmp_path: Path, key: str, value: object) -> None:
    """vLLM takes MXFP8 only as group 32, symmetric, torch.uint8 scales (CompressedTensorsConfig._is_mxfp8):
    anything else is a format fp8fix does not read yet, and no row is judged."""
    src = mxfp8_compressed_tensors(tmp_path / "mx")
    config = json.loads((src / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.pop(key) if value is None else weights.__setitem__(key, value)
    (src / "config.json").write_text(json.dumps(config))
    report = json.loads(run_cli("inspect", src, "--json").output)
    assert {v["verdict"] for v in report["loaders"].values()} == {"not-judged"}
    assert "not supported yet" in report["format_label"]


def test_the_mx_value_range_is_what_bf16_holds() -> None:
    """A sanity check of the fixtures above: 448 x 2^127 overflows BF16; 2^-9 x 2^-127 is below its normal range."""
    assert spec_e4m3(0x7E) * spec_e8m0(254) > float(torch.finfo(torch.bfloat16).max)
    assert 0 < spec_e4m3(0x01) * spec_e8m0(0) < 2.0**-126 and math.isnan(spec_e8m0(255))


def test_tp_sizes_are_not_judged_with_the_fp8_block_rules(tmp_path: Path) -> None:
    """vLLM's FP8 block loading (128 x 128 grids split per rank) is not how its MXFP8 scheme loads: `--tp` says
    it is not judged, and no row fails at a size for want of whole 128-blocks (a Phi-3's rank shares at TP 4 are
    no whole number of them)."""
    src = mxfp8_compressed_tensors(tmp_path / "phi3", phi3())
    report = json.loads(run_cli("inspect", src, "--tp", "2,4", "--json").output)
    assert report["tensor_parallel"] is None
    assert {f["code"] for f in report["findings"]} == {"row-not-judged"}
    said = [n for n in report["notes"] if n.startswith("--tp ")]
    assert len(said) == 2 and all("MXFP8" in n and "not judged" in n for n in said), said


#: Shapes whose every projection is whole 128 x 128 blocks (head_dim 128), as real models' are: vLLM refuses
#: block FP8 whose packed rows are not (a row of its own here, the FP8 block rules').
WHOLE_BLOCKS = {
    "llama": lambda: llama(hidden=256, heads=2, kv_heads=1, intermediate=256, layers=1),
    "phi3": lambda: phi3(hidden=256, heads=2, kv_heads=1, intermediate=256, layers=1),
}


@pytest.mark.parametrize("name", WHOLE_BLOCKS)
def test_blocks_128_writes_each_value_at_its_block_power_of_two(tmp_path: Path, name: str) -> None:
    """`--blocks 128x128`: every code is the MX value over its 128 x 128 block's power of two, rounded once
    (tests/test_mx_blocks.py's independent computation, applied block row by block row); verify agrees (run_cli
    runs it); the config says FP8_BLOCK; the rows are the block-FP8 rows (measured: tests/loaders)."""
    from tests.test_mx_blocks import expected

    src = mxfp8_compressed_tensors(tmp_path / name, WHOLE_BLOCKS[name](), seed=3)
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "128x128", "--json")
    assert result.exit_code == 0, result.output
    source, out = load_file(model_file(src)), load_file(model_file(tmp_path / "out"))
    for layer in [n.removesuffix(".weight_scale") for n in source if n.endswith(".weight_scale")]:
        codes, exponents = source[f"{layer}.weight"], source[f"{layer}.weight_scale"]
        rows, cols = codes.shape
        want_codes, want_scales = [], []
        for r in range(0, rows, 128):
            block_codes = codes[r : r + 128].view(torch.uint8).flatten().tolist()
            new, ks, _ = expected(
                bytes(block_codes), bytes(exponents[r : r + 128].flatten().tolist()), min(128, rows - r), cols
            )
            want_codes += new
            want_scales.append([2.0**k for k in ks])
        assert out[f"{layer}.weight"].view(torch.uint8).flatten().tolist() == want_codes, layer
        assert out[f"{layer}.weight_scale"].dtype == torch.float32
        assert out[f"{layer}.weight_scale"].tolist() == want_scales, layer
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["block_structure"]) == ("block", [128, 128])
    report = json.loads(result.output)
    assert report["reblocked"] and all(m["blocks_exact"] is not None for m in report["reblocked"])
    # what convert said OUTPUT's rows are is what inspect says of OUTPUT (one set of facts)
    rows = json.loads(run_cli("inspect", tmp_path / "out", "--json").output)["loaders"]
    assert {r: v["verdict"] for r, v in rows.items()} == {r: v["verdict"] for r, v in report["loaders"].items()}
    assert rows["transformers"]["verdict"] == "loads" and rows["vLLM >= 0.32"]["verdict"] == "loads"


def test_verify_catches_a_reblocked_code_that_moved(tmp_path: Path) -> None:
    src = mxfp8_compressed_tensors(tmp_path / "mx")
    assert run_cli("convert", src, tmp_path / "out", "--blocks", "128x128").exit_code == 0
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite(
        tmp_path / "out",
        lambda t: t[name].view(torch.uint8).__setitem__((3, 100), t[name].view(torch.uint8)[3, 100] ^ 1),
    )
    result = run_cli("verify", src, tmp_path / "out")
    assert result.exit_code == 1 and f"'{name}' block row 0 column block 0 row 3 column 100" in result.output


def test_blocks_is_for_mx_checkpoints_and_alone(tmp_path: Path) -> None:
    plain = build(tmp_path / "fp8", phi3())
    result = run_cli("convert", plain, tmp_path / "out", "--blocks", "128x128")
    assert result.exit_code == 3 and "re-blocks MXFP8 and MXFP4 checkpoints" in result.output
    mx = mxfp8_compressed_tensors(tmp_path / "mx")
    result = run_cli("convert", mx, tmp_path / "out", "--blocks", "128x128", "--to", "bf16")
    assert result.exit_code == 2 and "drop --to" in result.output
    assert not (tmp_path / "out").exists()
