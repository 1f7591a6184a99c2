"""What verify measures, stated by the test from the tensors themselves (issue 48's mutation sample of
`fp8fix/verification/`: each of these survived a planted change before it was written).

The worst error of a requantized weight, the place of a NaN code, the number of input scales checked, a plain
config key set to null, and every stray of a name list: computed here from the files, never from verify's own
output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FP8, build, phi3
from tests.conftest import load_tensors, patch_bytes, read_raw_header, run_cli, shard_files

QKV1 = "model.layers.1.self_attn.qkv_proj"


def verify_json(src: Path, out: Path) -> tuple[int, dict]:
    result = run_cli("verify", src, out, "--json")
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def fused(tmp_path: Path) -> tuple[Path, Path]:
    """A Phi-3 with one scale per shard written with one scale per fused module: requantized rows."""
    src, out = build(tmp_path / "src", phi3(), scale="shard"), tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "-q").exit_code == 0
    return src, out


def test_a_requantized_weights_record_carries_its_worst_error(fused: tuple[Path, Path]) -> None:
    src, out = fused
    model, s, o = phi3(), load_tensors(src), load_tensors(out)
    code, report = verify_json(src, out)
    assert code == 0
    records = {w["tensor"]: w for w in report["weights"]}
    for f in model.fused:
        for layer in range(model.layers):
            module = model.layer_prefix.format(i=layer) + f.suffix
            scale = s[f"{module}.weight_scale"].reshape(-1).double()
            rows = torch.cat([scale[i].expand(n) for i, n in enumerate(f.rows)])[:, None]
            source_values = s[f"{module}.weight"].double() * rows
            output_values = o[f"{module}.weight"].double() * o[f"{module}.weight_scale"].double()
            worst = float((output_values - source_values).abs().max())
            record = records[f"{module}.weight"]
            assert worst > 0 and record["kind"] == "requantized"
            assert record["max_error"] == pytest.approx(worst, rel=1e-5), module


def test_a_nan_code_is_named_where_it_is(fused: tuple[Path, Path]) -> None:
    src, out = fused
    weight = load_tensors(out)[f"{QKV1}.weight"]
    row, column = 37, 11
    patch_bytes(out, f"{QKV1}.weight", {row * weight.shape[1] + column: 0x7F})  # e4m3fn's NaN
    code, report = verify_json(src, out)
    assert code == 1
    assert any(f"'{QKV1}.weight'" in p and f"row {row} column {column}:" in p for p in report["problems"]), report


@pytest.mark.parametrize("layout", ["fused", "per-shard", "unfused"])
def test_every_input_scale_of_output_is_counted_once(tmp_path: Path, layout: str) -> None:
    src, out = build(tmp_path / "src", phi3()), tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", layout, "-q").exit_code == 0
    header_names = [n for path in sorted(out.glob("*.safetensors")) for n in read_raw_header(path)[0]]
    input_scales = [n for n in header_names if n.endswith(".input_scale")]
    assert input_scales
    code, report = verify_json(src, out)
    assert code == 0 and report["scales_checked"] == len(input_scales)


def test_a_plain_config_key_set_to_null_is_a_difference(tmp_path: Path) -> None:
    src, out = build(tmp_path / "src", phi3()), tmp_path / "out"
    assert run_cli("convert", src, out, "--to", "bf16", "-q").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["rope_scaling_extra"] = None
    (out / "config.json").write_text(json.dumps(config))
    code, report = verify_json(src, out)
    assert code == 1
    assert "config.json: rope_scaling_extra is None; a plain model of SOURCE's has absent" in report["problems"]


def test_every_stray_of_a_name_list_is_named(tmp_path: Path) -> None:
    src, out = build(tmp_path / "src", phi3()), tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "keep", "--layout", "unfused", "-q").exit_code == 0
    strays = ["model.layers.0.no_such_a", "model.layers.0.no_such_b"]
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] += strays
    (out / "config.json").write_text(json.dumps(config))
    code, report = verify_json(src, out)
    assert code == 1
    named = f"names {', '.join(map(repr, strays))}, which is no module of OUTPUT and not in SOURCE's list"
    assert any(named in p for p in report["problems"]), report["problems"]


def test_a_huge_stray_is_named_by_its_start_and_the_rest_counted(tmp_path: Path) -> None:
    """A hostile OUTPUT's stray entry of 200,000 characters, among 50: the problem shows each of the first three
    cut to 80 characters and counts the others, instead of echoing megabytes."""
    src, out = build(tmp_path / "src", phi3()), tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "keep", "--layout", "unfused", "-q").exit_code == 0
    huge = "model.layers.0." + "x" * 200_000
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] += [huge] + [f"model.layers.0.stray_{i}" for i in range(49)]
    (out / "config.json").write_text(json.dumps(config))
    code, report = verify_json(src, out)
    assert code == 1
    (problem,) = [p for p in report["problems"] if "which is no module of OUTPUT" in p]
    assert len(problem) < 600, problem[:600]
    assert repr(huge)[:80] in problem and "'model.layers.0.stray_1'" in problem and "and 47 more" in problem


@pytest.mark.parametrize(
    ("fmt", "scale", "options"),
    [
        ("compressed-tensors", "channel", ()),
        ("fp8", "tensor", ("--layout", "channel", "--format", "compressed-tensors")),
    ],
)
def test_a_channel_scale_without_its_weight_is_a_difference(
    tmp_path: Path, fmt: str, scale: str, options: tuple[str, ...]
) -> None:
    """OUTPUT edited to drop a weight but keep its per-row scale (and its input scale): problems naming it, not
    a crash (verify raised KeyError reading the input scale's weight)."""
    src, out = build(tmp_path / "src", phi3(), fmt=fmt, scale=scale), tmp_path / "out"
    assert run_cli("convert", src, out, *options, "-q").exit_code == 0
    name = "model.layers.0.mlp.down_proj.weight"
    path = out / shard_files(out)[name]
    header, data = read_raw_header(path)
    kept = {n: v for n, v in header.items() if n != name and n != "__metadata__"}
    tensors = {}
    for n, v in kept.items():
        begin, end = v["data_offsets"]
        dtype = {"F8_E4M3": FP8, "F32": torch.float32, "BF16": torch.bfloat16}[v["dtype"]]
        tensors[n] = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8).view(dtype).reshape(v["shape"])
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=header.get("__metadata__"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    code, report = verify_json(src, out)
    assert code == 1
    assert f"tensor '{name}' of SOURCE is missing from OUTPUT" in report["problems"]


def test_a_zero_block_scale_of_output_is_named_as_outputs(tmp_path: Path) -> None:
    """A block scale no weight can be recovered from: the problem says which checkpoint holds it."""
    src, out = build(tmp_path / "src", phi3(), fmt="block-fp8"), tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "unfused", "-q").exit_code == 0
    scale = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    assert scale in shard_files(out)
    patch_bytes(out, scale, dict.fromkeys(range(4), 0))  # its first F32 block scale: 0.0
    code, report = verify_json(src, out)
    assert code == 1
    assert any(p.startswith("OUTPUT: ") and scale in p for p in report["problems"]), report["problems"]
