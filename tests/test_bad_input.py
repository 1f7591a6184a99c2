"""Every bad input gets one clear line, exit code 3, and nothing written; SOURCE is never touched."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.builders import build, phi3
from tests.conftest import folder_digest, read_raw_header, run_cli, stopped_while, write_raw, writing

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
QKV0 = "model.layers.0.self_attn.qkv_proj"
QKV1 = "model.layers.1.self_attn.qkv_proj"


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_header(path: Path, change: Callable[[dict], object], buffer: Callable[[bytes], bytes] = lambda b: b) -> None:
    header, data = read_raw_header(path)
    change(header)
    write_raw(path, header, buffer(data))


def entry(path: Path, name: str) -> dict:
    return read_raw_header(path)[0][name]


def first_two(header: dict) -> tuple[dict, dict]:
    items = sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0])
    return items[0], items[1]


def _overlap(h: dict) -> None:
    a, b = first_two(h)
    b["data_offsets"] = [b["data_offsets"][0] - 2, b["data_offsets"][1] - 2]
    a["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][1]]


def _gap(h: dict) -> None:
    a, _ = first_two(h)  # an F32 scalar at [0, 4]: as F16 it ends at 2, leaving 2 bytes unused
    assert a["dtype"] == "F32" and a["shape"] == []
    a["dtype"], a["data_offsets"] = "F16", [a["data_offsets"][0], a["data_offsets"][0] + 2]


def _size_mismatch(h: dict) -> None:
    h[QKV0 + ".weight"]["shape"] = [100, 64]


def _nan_last_shard(src: Path) -> None:
    """0x7F/0xFF (NaN in e4m3fn) in a weight `--layout fused` requantizes, in the LAST shard: fails midway."""
    build(src, phi3(), scale="shard")  # per-shard scale vectors: the fused layout requantizes
    path = src / SHARD2
    header, data = read_raw_header(path)
    begin = header[QKV1 + ".weight"]["data_offsets"][0]
    patched = bytearray(data)
    patched[begin + 5] = 0x7F
    patched[begin + 700] = 0xFF
    write_raw(path, header, bytes(patched))
    return ("--layout", "fused")


CASES: dict[str, tuple[Callable[[Path], object], list[str]]] = {
    "missing config": (lambda s: (s / "config.json").unlink(), ["config.json", "missing"]),
    "invalid config": (lambda s: (s / "config.json").write_text("{not json"), ["config.json", "invalid JSON"]),
    "no architectures": (
        lambda s: edit_json(s / "config.json", lambda c: c.pop("architectures")),
        ["config.json", "architectures"],
    ),
    "unknown architecture": (
        lambda s: edit_json(s / "config.json", lambda c: c.update(architectures=["MadeUpForCausalLM"])),
        ["MadeUpForCausalLM", "Phi3ForCausalLM"],
    ),
    "config does not match weights": (
        lambda s: edit_json(s / "config.json", lambda c: c.update(num_key_value_heads=4)),
        [QKV0 + ".weight", "128 rows", "does not match"],
    ),
    "no quantization_config": (
        lambda s: edit_json(s / "config.json", lambda c: c.pop("quantization_config")),
        ["quantization_config"],
    ),
    "weight without scale": (
        lambda s: _rename_tensor(s, "model.layers.0.mlp.down_proj.weight_scale", "model.layers.0.mlp.down_proj.scale"),
        ["model.layers.0.mlp.down_proj.weight", "no scale", "weight_scale"],
    ),
    "scale of unknown shape": (
        lambda s: _reshape_scale(s),
        ["model.layers.0.mlp.down_proj.weight_scale", "[2, 2]", "no known convention"],
    ),
    "zero weight scale": (
        lambda s: _set_scale(s, "model.layers.0.mlp.down_proj.weight_scale", 0.0),
        ["model.layers.0.mlp.down_proj.weight_scale", "holds 0.0", "finite and positive"],
    ),
    "NaN input scale": (
        lambda s: _set_scale(s, "model.layers.0.self_attn.o_proj.input_scale", float("nan")),
        ["model.layers.0.self_attn.o_proj.input_scale", "holds nan"],
    ),
    "header past end of file": (
        lambda s: (s / SHARD1).write_bytes((10**6).to_bytes(8, "little") + b"{}"),
        [SHARD1, "past the end"],
    ),
    "header not JSON": (lambda s: write_raw(s / SHARD1, b'{"a": [1, 2', b""), [SHARD1, "not valid JSON"]),
    "truncated data": (lambda s: _truncate(s / SHARD2), [SHARD2, "truncated"]),
    "offsets out of range": (
        lambda s: edit_header(s / SHARD1, lambda h: h[QKV0 + ".weight"].update(data_offsets=[0, 10**9])),
        [SHARD1, QKV0 + ".weight"],
    ),
    "overlapping tensors": (lambda s: edit_header(s / SHARD1, _overlap), [SHARD1, "overlaps"]),
    "gap between tensors": (lambda s: edit_header(s / SHARD1, _gap), [SHARD1, "gap"]),
    "byte size does not match shape": (lambda s: edit_header(s / SHARD1, _size_mismatch), [SHARD1, QKV0, "needs"]),
    "index names a missing file": (
        lambda s: (s / SHARD2).unlink(),
        [SHARD2, "does not exist"],
    ),
    "index path outside SOURCE": (
        lambda s: edit_json(
            s / "model.safetensors.index.json",
            lambda i: i["weight_map"].update({"model.norm.weight": "../elsewhere.safetensors"}),
        ),
        ["../elsewhere.safetensors", "outside"],
    ),
    "index names a tensor its file lacks": (
        lambda s: edit_json(
            s / "model.safetensors.index.json", lambda i: i["weight_map"].update({"model.norm.weight": SHARD1})
        ),
        ["model.norm.weight", SHARD1, "does not contain"],
    ),
    "NaN codes in a rewritten weight (last shard: fails midway)": (
        _nan_last_shard,
        [SHARD2, QKV1 + ".weight", "2 NaN codes (0x7F/0xFF)"],
    ),
    "compressed-tensors int weights": (
        lambda s: edit_json(
            s / "config.json",
            lambda c: c["quantization_config"].update(quant_method="compressed-tensors", format="pack-quantized"),
        ),
        ["compressed-tensors format 'pack-quantized'", "not supported yet"],
    ),
    "quark int8": (
        lambda s: edit_json(
            s / "config.json",
            lambda c: c["quantization_config"].update(
                quant_method="quark", global_quant_config={"weight": {"dtype": "int8", "qscheme": "per_tensor"}}
            ),
        ),
        ["AMD Quark int8", "not supported yet"],
    ),
    "not an FP8 method": (
        lambda s: edit_json(s / "config.json", lambda c: c["quantization_config"].update(quant_method="gptq")),
        ["quant_method 'gptq'", "not an FP8 format"],
    ),
    "modelopt nvfp4 of FP8 weights": (
        lambda s: _modelopt(s, "NVFP4"),
        ["ModelOpt config declares NVFP4", "the config does not match the weights"],
    ),
    "modelopt w4a8": (
        lambda s: _modelopt(s, "W4A8_AWQ"),
        ["ModelOpt W4A8_AWQ", "not supported yet"],
    ),
}


def _modelopt(src: Path, algo: str) -> None:
    edit_json(src / "config.json", lambda c: c.pop("quantization_config"))
    (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": algo}}))


def _rename_tensor(src: Path, old: str, new: str) -> None:
    edit_header(src / SHARD1, lambda h: h.update({new: h.pop(old)}))
    edit_json(src / "model.safetensors.index.json", lambda i: i["weight_map"].update({new: i["weight_map"].pop(old)}))


def _reshape_scale(src: Path) -> None:
    path = src / SHARD1
    header, data = read_raw_header(path)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    header[name]["shape"] = [2, 2]
    begin, end = header[name]["data_offsets"]
    grow = 12
    for v in header.values():
        if isinstance(v, dict) and "data_offsets" in v and v["data_offsets"][0] >= end:
            v["data_offsets"] = [v["data_offsets"][0] + grow, v["data_offsets"][1] + grow]
    header[name]["data_offsets"] = [begin, end + grow]
    write_raw(path, header, data[:end] + b"\x00" * grow + data[end:])


def _set_scale(src: Path, name: str, value: float) -> None:
    """Overwrite a float32 scale's bytes in place (the header stays as the exporter wrote it)."""
    path = src / SHARD1
    header, data = read_raw_header(path)
    begin, end = header[name]["data_offsets"]
    assert header[name]["dtype"] == "F32" and end - begin == 4
    write_raw(path, header, data[:begin] + struct.pack("<f", value) + data[end:])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_cleanly(tmp_path: Path, case: str) -> None:
    src = build(tmp_path / "src", phi3())
    breaker, expected = CASES[case]
    options = breaker(src)
    before = folder_digest(src)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "-q", *(options if isinstance(options, tuple) else ()))
    assert result.exit_code == 3, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("Error: ")
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "Traceback" not in result.output
    assert not out.exists(), "OUTPUT written for a bad input"
    assert [p.name for p in tmp_path.iterdir()] == ["src"], "staging folder left behind"
    assert folder_digest(src) == before, "SOURCE was modified"


def test_no_fp8_tensor(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(src / "model.safetensors"))
    config = {"architectures": ["Phi3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}}
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3
    assert "no FP8 tensor" in result.output


def test_errors_print_one_line_without_traceback_from_the_real_process(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    (src / "config.json").write_text("[")
    proc = subprocess.run(
        [sys.executable, "-m", "fp8fix", "convert", str(src), str(tmp_path / "out")], capture_output=True, text=True
    )
    assert proc.returncode == 3
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"Error: SOURCE {src}: config.json: invalid JSON")
    assert "Traceback" not in proc.stderr


def test_usage_errors_keep_click_exit_code(tmp_path: Path) -> None:
    assert run_cli("convert", tmp_path).exit_code == 2
    assert run_cli("convert", tmp_path, tmp_path / "o", "--layout", "sideways").exit_code == 2


def test_existing_output_is_refused_without_overwrite(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("convert", src, out, "-q")
    assert result.exit_code == 2 and "--overwrite" in result.output  # a usage error
    assert (out / "keep.txt").read_text() == "mine"


def test_overwrite_replaces_only_what_fp8fix_wrote(tmp_path: Path) -> None:
    """Issue 48: --overwrite of a folder fp8fix did not write (no card with its tag), or of an fp8fix output a
    user added files to, is refused naming each file it would lose; nothing is touched; an fp8fix output as
    written (and one whose copied files the new conversion writes again) is replaced."""
    src = build(tmp_path / "src", phi3())
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "notes").mkdir()
    (out / "notes" / "eval.json").write_text("{}")
    result = run_cli("convert", src, out, "-q", "--overwrite")
    assert result.exit_code == 2 and "keep.txt" in result.output and "notes/eval.json" in result.output
    assert (out / "keep.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    for p in (out / "keep.txt", out / "notes" / "eval.json", out / "notes"):
        p.unlink() if p.is_file() else p.rmdir()
    assert run_cli("convert", src, out, "-q", "--overwrite").exit_code == 0  # empty
    written = sorted(p.name for p in out.iterdir())
    assert "README.md" in written and "tokenizer_config.json" in written
    assert run_cli("convert", src, out, "-q", "--overwrite", "--layout", "per-shard").exit_code == 0  # fp8fix's
    (out / "my-eval.md").write_text("results")
    result = run_cli("convert", src, out, "-q", "--overwrite")
    assert result.exit_code == 2 and "my-eval.md" in result.output and "README.md" not in result.output
    assert (out / "my-eval.md").exists()
    (out / "my-eval.md").unlink()
    card = (out / "README.md").read_text()
    (out / "README.md").write_text(card.replace("- fp8fix\n", ""))  # a card without fp8fix's tag: not its folder
    result = run_cli("convert", src, out, "-q", "--overwrite")
    assert result.exit_code == 2 and "README.md" in result.output and "config.json" in result.output
    (out / "README.md").write_text(card)
    assert run_cli("convert", src, out, "-q", "--overwrite").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == written and sorted(p.name for p in tmp_path.iterdir()) == [
        "out",
        "src",
    ]


def test_empty_existing_output_is_fine(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    (tmp_path / "out").mkdir()
    assert run_cli("convert", src, tmp_path / "out", "-q").exit_code == 0


@pytest.mark.parametrize("where", ["inside", "same"])
def test_output_never_inside_source(tmp_path: Path, where: str) -> None:
    src = build(tmp_path / "src", phi3())
    before = folder_digest(src)
    out = src / "converted" if where == "inside" else src
    result = run_cli("convert", src, out, "--overwrite")
    assert result.exit_code == 2 and "SOURCE" in result.output  # a usage error
    assert folder_digest(src) == before


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    result = run_cli("convert", src, tmp_path / "out", "--format", "keep", "--dry-run")
    assert result.exit_code == 0
    assert "unfuse" in result.output and "q_proj, k_proj, v_proj" in result.output
    assert "nothing written" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_interrupt_leaves_no_output(tmp_path: Path) -> None:
    """Ctrl-C while shards are being written: exit 130, no OUTPUT, no staging folder."""
    import signal

    src = build(tmp_path / "src", phi3(hidden=1024, intermediate=4096, layers=8), files=4, extra_files=False)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8fix", "convert", str(src), str(out), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a shell without job control starts background jobs with SIGINT ignored, and a process inherits
        # that (Python then installs no KeyboardInterrupt handler): a suite run with `&` would see exit 0
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    with stopped_while(proc, lambda: writing(tmp_path, "out", 4)):  # stopped mid-write: no race to lose
        proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Interrupted" in stderr and "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
