"""verify: passes on faithful conversions (every conversion of the suite is verified in conftest.run_cli),
and fails, naming the tensor, on each kind of damage."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from tests.builders import build, phi3
from tests.conftest import patch_bytes, run_cli, shard_files

Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def converted(tmp_path: Path) -> tuple[Path, Path]:
    src = build(tmp_path / "src", phi3())
    assert run_cli("convert", src, tmp_path / "out", "--format", "keep", "-q").exit_code == 0
    return src, tmp_path / "out"


def verify(src: Path, out: Path) -> tuple[int, dict]:
    result = run_cli("verify", src, out, "--json")
    return result.exit_code, json.loads(result.output)


def test_faithful_conversion_passes(converted: tuple[Path, Path]) -> None:
    code, report = verify(*converted)
    assert code == 0 and report["ok"] and report["problems"] == []
    assert len(report["weights"]) == 8 and {w["kind"] for w in report["weights"]} == {"exact"}
    assert report["identical_tensors"] > 0


def flip(folder: Path, tensor: str, offset: int, bit: int = 0x01) -> None:
    from tests.conftest import read_raw_header

    header, data = read_raw_header(folder / shard_files(folder)[tensor])
    patch_bytes(folder, tensor, {offset: data[header[tensor]["data_offsets"][0] + offset] ^ bit})


def test_one_changed_weight_byte_is_caught(converted: tuple[Path, Path]) -> None:
    src, out = converted
    flip(out, Q0 + ".weight", 100)
    code, report = verify(src, out)
    assert code == 1 and any(Q0 + ".weight" in p for p in report["problems"])


def test_one_changed_scale_byte_is_caught(converted: tuple[Path, Path]) -> None:
    src, out = converted
    flip(out, Q0 + ".weight_scale", 0)  # the lowest mantissa bit: a tiny change, still caught
    code, report = verify(src, out)
    assert code == 1 and any(Q0 + ".weight" in p for p in report["problems"])


def test_a_doubled_scale_without_an_encoding_change_is_caught(converted: tuple[Path, Path]) -> None:
    src, out = converted
    with safe_open(out / shard_files(out)[Q0 + ".weight_scale"], framework="pt") as f:
        value = float(f.get_tensor(Q0 + ".weight_scale"))
    patch_bytes(out, Q0 + ".weight_scale", dict(enumerate(struct.pack("<f", value * 2))))
    code, report = verify(src, out)
    assert code == 1 and any(Q0 + ".weight" in p for p in report["problems"])


def test_a_dropped_tensor_is_caught(converted: tuple[Path, Path]) -> None:
    src, out = converted
    dropped = "model.layers.1.self_attn.v_scale"
    file = shard_files(out)[dropped]
    with safe_open(out / file, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != dropped}
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"][dropped]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    code, report = verify(src, out)
    assert code == 1 and any(f"'{dropped}'" in p and "missing" in p for p in report["problems"])


def test_a_changed_kv_scale_and_a_changed_copied_file_are_caught(converted: tuple[Path, Path]) -> None:
    src, out = converted
    flip(out, "model.layers.0.self_attn.k_scale", 1)
    (out / "generation_config.json").write_text("{}")
    code, report = verify(src, out)
    assert code == 1
    assert any("model.layers.0.self_attn.k_scale" in p for p in report["problems"])
    assert any("generation_config.json" in p for p in report["problems"])


def test_a_changed_input_scale_is_caught(converted: tuple[Path, Path]) -> None:
    src, out = converted
    flip(out, Q0 + ".input_scale", 0)
    code, report = verify(src, out)
    assert code == 1 and any(Q0 + ".input_scale" in p for p in report["problems"])


def test_verify_reports_requantization_errors(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), scale="shard")
    assert run_cli("convert", src, tmp_path / "out", "--layout", "fused", "-q").exit_code == 0
    code, report = verify(src, tmp_path / "out")
    assert code == 0
    requantized = [w for w in report["weights"] if w["kind"] == "requantized"]
    assert len(requantized) == 4 and all(0 < w["max_error_steps"] <= 0.5 for w in requantized)
    text = run_cli("verify", src, tmp_path / "out").output
    assert text.startswith("faithful") and "requantized" in text


def test_convert_verify_fails_without_leaving_output(tmp_path: Path) -> None:
    """--verify runs on the staged output before the rename: faithful output appears, with the summary in the card."""
    src = build(tmp_path / "src", phi3())
    result = run_cli("convert", src, tmp_path / "out", "--verify", "--json", "-q")
    assert result.exit_code == 0
    assert json.loads(result.output)["verification"]["ok"] is True
    assert "Verified with `fp8fix verify`" in (tmp_path / "out" / "README.md").read_text()


def test_verify_invalid_input_is_exit_3(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    assert run_cli("verify", src, tmp_path / "missing").exit_code == 3
