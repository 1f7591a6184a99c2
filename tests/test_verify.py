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
from tests.conftest import patch_bytes, run_cli, run_process, shard_files

Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def converted(tmp_path: Path) -> tuple[Path, Path]:
    src = build(tmp_path / "src", phi3())
    assert run_cli("convert", src, tmp_path / "out", "--format", "keep", "-q").exit_code == 0
    return src, tmp_path / "out"


def verify(src: Path, out: Path) -> tuple[int, dict]:
    result = run_cli("verify", src, out, "--json")
    return result.exit_code, json.loads(result.stdout)


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


def test_requantized_errors_are_those_of_torch_float32(tmp_path: Path) -> None:
    """verify checks requantized rows through byte maps; its errors must be the float32 errors torch
    computes from the two checkpoints, and one changed code or a source NaN must be caught."""
    import torch

    from tests.conftest import load_tensors

    src = build(tmp_path / "src", phi3(), scale="shard")
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "-q").exit_code == 0
    code, report = verify(src, out)
    assert code == 0
    s, o = load_tensors(src), load_tensors(out)
    rows = {"qkv_proj": [64, 32, 32], "gate_up_proj": [128, 128]}
    for w in (w for w in report["weights"] if w["kind"] == "requantized"):
        module = w["tensor"].removesuffix(".weight")
        per_row = torch.repeat_interleave(s[module + ".weight_scale"], torch.tensor(rows[module.split(".")[-1]]))
        source = s[w["tensor"]].float() * per_row.reshape(-1, 1)
        codes, scale = o[w["tensor"]].float(), o[module + ".weight_scale"].float()
        q = source / scale  # the exact code at the output scale; its fp8 step is 2^(exponent - 1 - 3)
        step = torch.exp2((torch.frexp(q)[1] - 1).clamp(min=-6).float() - 3)
        assert w["max_error"] == float((codes * scale - source).abs().max())
        assert w["max_error_steps"] == float(((codes - q).abs() / step).max())
    flip(out, "model.layers.1.mlp.gate_up_proj.weight", 300)
    code, report = verify(src, out)
    assert code == 1 and any("model.layers.1.mlp.gate_up_proj.weight" in p for p in report["problems"])
    patch_bytes(src, "model.layers.0.self_attn.qkv_proj.weight", {5: 0x7F})
    code, report = verify(src, out)
    assert code == 1 and any("NaN codes" in p and "qkv_proj" in p for p in report["problems"])


def test_rows_that_round_are_counted_as_torch_counts_them(tmp_path: Path) -> None:
    """Shard scales a power of two apart: the smaller shard's codes are halved exactly except those that
    round; verify (byte maps, no torch) counts them and their error as torch's float32 arithmetic does."""
    import torch

    from tests.conftest import load_tensors

    src = build(tmp_path / "src", phi3(), scale="shard")
    qkv = "model.layers.0.self_attn.qkv_proj"
    packed = struct.pack("<3f", 0.01, 0.02, 0.02)  # q at half the top scale: its codes halve at the top scale
    patch_bytes(src, qkv + ".weight_scale", dict(enumerate(packed)))
    patch_bytes(src, qkv + ".weight", {0: 0x01, 1: 0x83, 2: 0x09, 3: 0x8B, 4: 0x02})  # odd smallest codes round
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "-q").exit_code == 0
    code, report = verify(src, out)
    assert code == 0
    check = next(w for w in report["weights"] if w["tensor"] == qkv + ".weight")
    q = load_tensors(src)[qkv + ".weight"][:64].float()
    halved = q / 2
    rounded = int((halved.to(torch.float8_e4m3fn).float() != halved).sum())
    assert rounded > 0 and check["kind"] == "rounded" and check["rounded_codes"] == rounded
    o = load_tensors(out)[qkv + ".weight"][:64].float()
    assert check["max_error"] == float((o * torch.tensor(0.02) - q * torch.tensor(0.01)).abs().max())


def test_convert_verify_fails_without_leaving_output(tmp_path: Path) -> None:
    """--verify runs on the staged output before the rename: faithful output appears, with the summary in the card."""
    src = build(tmp_path / "src", phi3())
    result = run_cli("convert", src, tmp_path / "out", "--verify", "--json", "-q")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["verification"]["ok"] is True
    assert "Verified with `fp8fix verify`" in (tmp_path / "out" / "README.md").read_text()


def test_verify_invalid_input_is_exit_3_and_a_missing_output_a_usage_error(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    assert run_cli("verify", src, tmp_path / "missing").exit_code == 2  # as a missing SOURCE (issue 48)
    (tmp_path / "empty").mkdir()
    assert run_cli("verify", src, tmp_path / "empty").exit_code == 3


@pytest.mark.parametrize("damaged", [False, True])
def test_jobs_give_the_same_report(tmp_path: Path, damaged: bool) -> None:
    """verify --jobs N checks runs of tensors in N processes; the report, problems in order, is --jobs 1's."""
    src = build(tmp_path / "src", phi3(layers=4), scale="shard", files=3)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "--to", "e4m3fnuz", "-q").exit_code == 0
    if damaged:
        flip(out, "model.layers.3.mlp.down_proj.weight", 7)
        flip(out, Q0.replace("q_proj", "qkv_proj") + ".weight", 9)
        flip(out, "model.layers.2.input_layernorm.weight", 0)
    reports = [run_process("verify", src, out, "--json", "--jobs", str(n)) for n in (1, 2, 3)]
    assert {r.returncode for r in reports} == {1 if damaged else 0}
    first = json.loads(reports[0].stdout)
    assert all(json.loads(r.stdout) == first for r in reports[1:])
    assert len(first["weights"]) == 16 and len(first["problems"]) == (3 if damaged else 0)


@pytest.mark.parametrize("damaged", [False, True])
def test_parts_check_every_tensor_once(tmp_path: Path, damaged: bool) -> None:
    """verify --part K/N for K = 1..N: each weight checked by exactly one part, together the whole
    verify; a changed code is found by the one part that holds it, the others pass."""
    src = build(tmp_path / "src", phi3(layers=4), scale="shard", files=3)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "fused", "--to", "e4m3fnuz", "-q").exit_code == 0
    broken = "model.layers.2.mlp.down_proj.weight"
    if damaged:
        flip(out, broken, 3)
    whole = json.loads(run_process("verify", src, out, "--json").stdout)
    for n in (1, 2, 3, 5):
        parts = [run_process("verify", src, out, "--json", "--part", f"{k}/{n}") for k in range(1, n + 1)]
        reports = [json.loads(p.stdout) for p in parts]
        assert [r["part"] for r in reports] == [[k, n] for k in range(1, n + 1)]
        checked = [w["tensor"] for r in reports for w in r["weights"]]
        assert sorted(checked) == sorted(w["tensor"] for w in whole["weights"]), n
        assert sum(r["identical_tensors"] for r in reports) == whole["identical_tensors"]
        if n > 1:  # a share is about 1/N of the weights, not all of them in one part
            assert max(len(r["weights"]) for r in reports) < len(whole["weights"])
        failing = [p.returncode for p in parts].count(1)
        assert failing == (1 if damaged else 0), n
        assert all(p.returncode in (0, 1) for p in parts)
        if damaged:
            bad = next(r for r, p in zip(reports, parts, strict=True) if p.returncode == 1)
            assert broken in " ".join(bad["problems"]) and broken in [w["tensor"] for w in bad["weights"]]
    text = run_process("verify", src, out, "--part", "2/3")
    assert "part 2/3:" in text.stdout
    assert run_process("verify", src, out, "--part", "4/3").returncode == 2
