"""verify's records are what it measured (issue 48): a changed code, scale, padding, BF16 value, ignore list or
config size makes the weight's record `mismatch` (with the codes that differ counted), and the record, the
summary line, the problems and the exit code say the same thing. Expectations are counted here from what each
test tampered, not from verify's own output."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import build, phi3
from tests.conftest import patch_bytes, read_raw_header, run_cli, shard_files
from tests.test_parallel import deepseek_dense

DOWN0 = "model.layers.0.mlp.down_proj"


def original(folder: Path, tensor: str, offset: int) -> int:
    header, data = read_raw_header(folder / shard_files(folder)[tensor])
    return data[header[tensor]["data_offsets"][0] + offset]


def flip_codes(folder: Path, tensor: str, offsets: list[int]) -> None:
    """Change each code's lowest mantissa bit: a different value, never a NaN of e4m3fn."""
    patch_bytes(folder, tensor, {o: original(folder, tensor, o) ^ 0x02 for o in offsets})


def set_config(folder: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def tamper_scale(folder: Path) -> None:
    name = DOWN0 + ".weight_scale"
    value = struct.unpack("<f", bytes(original(folder, name, i) for i in range(4)))[0]
    patch_bytes(folder, name, dict(enumerate(struct.pack("<f", value * 1.5))))


def tamper_bf16(folder: Path) -> None:
    """One BF16 value of a `--to bf16` output, made twice as large (its exponent's lowest bit set or cleared)."""
    patch_bytes(folder, DOWN0 + ".weight", {1: original(folder, DOWN0 + ".weight", 1) ^ 0x01})


#: case -> (source builder, convert options, tamper, the weight whose record must be `mismatch` (None: a
#: config problem, no weight record changes), codes the tamper changed (None: not a difference of values))
CASES: dict[str, tuple[str, tuple[str, ...], Callable[[Path], None], str | None, int | None]] = {
    "one code": ("phi3", (), lambda f: flip_codes(f, DOWN0 + ".weight", [100]), DOWN0 + ".weight", 1),
    "three codes": ("phi3", (), lambda f: flip_codes(f, DOWN0 + ".weight", [3, 500, 1000]), DOWN0 + ".weight", 3),
    "codes of a requantized module": (
        "phi3-shard",
        ("--layout", "fused"),
        lambda f: flip_codes(f, "model.layers.1.self_attn.qkv_proj.weight", [0, 64 * 70]),
        "model.layers.1.self_attn.qkv_proj.weight",
        2,
    ),
    "a scale": ("phi3", ("--format", "keep"), tamper_scale, DOWN0 + ".weight", None),
    "a BF16 value": ("phi3", ("--to", "bf16"), tamper_bf16, DOWN0 + ".weight", 1),
    "padding": (
        "deepseek",
        ("--tp", "32"),
        lambda f: patch_bytes(f, DOWN0 + ".weight", {4608 + 7: 0x38}),
        DOWN0 + ".weight",
        None,
    ),
    "an ignore list": (
        "phi3",
        (),
        lambda f: set_config(f, lambda c: c["quantization_config"]["ignore"].append(DOWN0)),
        None,
        None,
    ),
    "a config size": (
        "phi3",
        (),
        lambda f: set_config(f, lambda c: c.update(intermediate_size=c["intermediate_size"] * 2)),
        None,
        None,
    ),
}
SOURCES = {
    "phi3": lambda p: build(p, phi3()),
    "phi3-shard": lambda p: build(p, phi3(), scale="shard"),
    "deepseek": deepseek_dense,
}


def summary_counts(line: str) -> dict[str, int]:
    """The counts verify's first text line states."""
    m = re.search(r"(\d+) quantized weights \((\d+) exact, (\d+) with rounded codes, (\d+) requantized", line)
    assert m, line
    counts = dict(zip(("weights", "exact", "rounded", "requantized"), map(int, m.groups()), strict=True))
    bf16 = re.search(r", (\d+) unquantized", line)
    mismatched = re.search(r", (\d+) MISMATCHED: (\d+) values", line)
    counts["dequantized"] = int(bf16.group(1)) if bf16 else 0
    counts["mismatch"], counts["values"] = map(int, mismatched.groups()) if mismatched else (0, 0)
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_record_summary_problems_and_exit_code_agree(tmp_path: Path, case: str) -> None:
    source, options, tamper, tensor, codes = CASES[case]
    src, out = SOURCES[source](tmp_path / "src"), tmp_path / "out"
    assert run_cli("convert", src, out, *options, "-q").exit_code == 0
    before = json.loads(run_cli("verify", src, out, "--json").stdout)
    assert before["ok"] and not any(w["kind"] == "mismatch" for w in before["weights"])
    tamper(out)
    result = run_cli("verify", src, out, "--json")
    report = json.loads(result.stdout)
    text = run_cli("verify", src, out)
    assert result.exit_code == text.exit_code == 1 and not report["ok"] and report["problems"]
    records = {w["tensor"]: w for w in report["weights"]}
    assert set(records) == {w["tensor"] for w in before["weights"]}
    mismatched = {name for name, w in records.items() if w["kind"] == "mismatch"}
    assert mismatched == ({tensor} if tensor else set())
    for name, w in records.items():  # every other record is what it was before the tamper
        if name != tensor:
            assert w == next(b for b in before["weights"] if b["tensor"] == name)
    if tensor is not None:
        record = records[tensor]
        assert record["mismatch"] and any(record["mismatch"] in p for p in report["problems"])
        if codes is not None:
            assert record["mismatched_codes"] == codes
    counts = summary_counts(text.output.splitlines()[0])
    kinds = [w["kind"] for w in report["weights"]]
    assert counts["weights"] == len(kinds)
    for kind in ("exact", "rounded", "requantized", "dequantized", "mismatch"):
        if kind != "dequantized" or counts["dequantized"]:
            assert counts[kind] == kinds.count(kind), kind
    assert counts["values"] == sum(w["mismatched_codes"] for w in report["weights"])
    assert text.output.splitlines()[0].startswith("MISMATCH") and f"{len(report['problems'])} problem(s)" in text.output
