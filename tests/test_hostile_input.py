"""The hostile-input campaign of issue 12, case by case: each fails cleanly, or converts to something loadable.

Every case starts from the shipped example checkpoint. A clean failure is one line, a
documented exit code, no traceback, no OUTPUT, no staging folder and SOURCE unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8fix.errors import InvalidCheckpoint
from fp8fix.io.safetensors_file import read_header
from fp8fix.io.staging import output_lock
from tests.builders import build, phi3
from tests.conftest import (
    folder_digest,
    read_raw_header,
    run_cli,
    safetensors_opens,
    shard_files,
    stopped_while,
    write_raw,
    writing,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "phi3-tiny-fp8"
SHARD1 = "model-00001-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
QKV = "model.layers.0.self_attn.qkv_proj"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return Path(shutil.copytree(EXAMPLE, tmp_path / "src"))


def assert_clean_failure(result: Any, tmp_path: Path, source: Path, before: dict[str, str], codes: set[int]) -> str:
    assert result.exit_code in codes, result.output
    assert "Traceback" not in result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: "), result.output
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name not in {"src", "ref"})
    assert leftovers == [], f"left behind: {leftovers}"
    assert folder_digest(source) == before, "SOURCE changed"
    return line


def edit_json(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    result = change(data)
    path.write_text(json.dumps(data if result is None else result))


def add_tensor(folder: Path, name: str, tensor: torch.Tensor) -> None:
    """Add (or replace) a tensor in the example's first shard, and list it in the index."""
    path = folder / SHARD1
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors[name] = tensor
    save_file(tensors, path, metadata=metadata)
    edit_json(folder / INDEX, lambda idx: idx["weight_map"].__setitem__(name, SHARD1))


# --- 1. a fused bias that does not match its weight ---------------------------------------------------------


@pytest.mark.parametrize("shape", [[5], [], [0], [128, 1]])
@pytest.mark.parametrize("layout", ["unfused", "fused"])
def test_a_fused_bias_of_the_wrong_shape_is_refused(tmp_path: Path, src: Path, shape: list[int], layout: str) -> None:
    """Issue 12 item 1: a [5] bias beside a 128-row qkv_proj filled q_proj.bias with neighbouring bytes."""
    add_tensor(src, f"{QKV}.bias", torch.ones(shape, dtype=torch.bfloat16))
    before = folder_digest(src)
    result = run_cli("convert", src, tmp_path / "out", "-q", "--layout", layout, "--verify")
    line = assert_clean_failure(result, tmp_path, src, before, {3})
    assert f"'{QKV}.bias'" in line and "128 rows" in line


def test_a_fused_bias_of_the_right_shape_is_split_by_value(tmp_path: Path, src: Path) -> None:
    bias = torch.linspace(-2, 2, 128).bfloat16()
    add_tensor(src, f"{QKV}.bias", bias)
    assert run_cli("convert", src, tmp_path / "out", "-q", "--layout", "unfused").exit_code == 0
    out = {}
    for name, file in shard_files(tmp_path / "out").items():
        with safe_open(tmp_path / "out" / file, framework="pt") as f:
            out[name] = f.get_tensor(name)
    prefix = "model.layers.0.self_attn."
    assert torch.equal(out[prefix + "q_proj.bias"], bias[:64])
    assert torch.equal(out[prefix + "k_proj.bias"], bias[64:96])
    assert torch.equal(out[prefix + "v_proj.bias"], bias[96:])


def test_every_planned_piece_lies_inside_its_source_tensor(tmp_path: Path, src: Path) -> None:
    """The plan's invariant, independent of the shape checks upstream that usually catch the cause first."""
    from fp8fix.io.checkpoint import open_checkpoint
    from fp8fix.plan.pieces import CopyRange, OutputShard, OutputTensor
    from fp8fix.plan.planner import check_pieces_inside_sources

    ckpt = open_checkpoint(src)
    t = ckpt.tensors["model.layers.0.input_layernorm.weight"]
    inside = OutputTensor(t.name, t.dtype, t.shape, [CopyRange(t.path, t.start, t.end)], t.name)
    check_pieces_inside_sources([OutputShard(SHARD1, {}, [inside])], ckpt.tensors)
    spill = OutputTensor(t.name, "U8", (t.nbytes,), [CopyRange(t.path, t.start + 2, t.end + 2)], t.name)
    with pytest.raises(InvalidCheckpoint, match="outside its source tensor"):
        check_pieces_inside_sources([OutputShard(SHARD1, {}, [spill])], ckpt.tensors)


# --- 2. values of the wrong type: one line, exit 3, never a traceback ----------------------------------------


def _header_entry(name: str, key: str, value: Any) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        path = folder / shard_files(folder)[name]
        header, data = read_raw_header(path)
        header[name][key] = value
        write_raw(path, header, data)

    return change


def _raw_header_text(text_from: Callable[[str], str]) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        path = folder / SHARD1
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        body = text_from(data[8 : 8 + n].decode()).encode()
        path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n :])

    return change


def _config(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    return lambda folder: edit_json(folder / "config.json", change)


def _quantization(**values: Any) -> Callable[[Path], None]:
    return _config(lambda c: c["quantization_config"].update(values))


def _index_metadata(value: Any) -> Callable[[Path], None]:
    return lambda folder: edit_json(folder / INDEX, lambda idx: idx.__setitem__("metadata", value))


def _input_scale_dtype(dtype: torch.dtype) -> Callable[[Path], None]:
    return lambda folder: add_tensor(folder, f"{QKV}.input_scale", torch.tensor(3, dtype=dtype))


def _modelopt_file(content: bytes) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / "hf_quant_config.json").write_bytes(content)
        edit_json(folder / "config.json", lambda c: c.pop("quantization_config"))

    return change


HOSTILE: dict[str, Callable[[Path], None]] = {
    "header dtype a list": _header_entry(f"{QKV}.weight", "dtype", ["F8_E4M3"]),
    "header dtype an object": _header_entry(f"{QKV}.weight", "dtype", {"a": 1}),
    "header shape with a boolean": _header_entry(f"{QKV}.weight", "shape", [True, 64]),
    "header integer of 5000 digits": _raw_header_text(
        lambda h: h.replace('"shape":', '"x": 1' + "0" * 5000 + ', "shape":', 1)
    ),
    "header nested 100000 deep": _raw_header_text(lambda h: h[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "config nested 100000 deep": lambda f: (f / "config.json").write_text(
        '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    ),
    "config integer of 5000 digits": lambda f: (f / "config.json").write_text('{"hidden_size": 1' + "0" * 5000 + "}"),
    "index metadata a list": _index_metadata([1]),
    "index metadata a string": _index_metadata("x"),
    "index metadata a number": _index_metadata(7),
    "input_scale I32": _input_scale_dtype(torch.int32),
    "input_scale I64": _input_scale_dtype(torch.int64),
    "input_scale U8": _input_scale_dtype(torch.uint8),
    "input_scale F8": _input_scale_dtype(torch.float8_e4m3fn),
    "num_attention_heads 0": _config(lambda c: c.update(num_attention_heads=0)),
    "num_attention_heads '4'": _config(lambda c: c.update(num_attention_heads="4")),
    "num_attention_heads [4]": _config(lambda c: c.update(num_attention_heads=[4])),
    "num_attention_heads {}": _config(lambda c: c.update(num_attention_heads={})),
    "weight_block_size '128x'": _quantization(weight_block_size="128x"),
    "weight_block_size [true, 1]": _quantization(weight_block_size=[True, 1]),
    "config_groups a list": _quantization(
        quant_method="compressed-tensors", format="float-quantized", config_groups=[1]
    ),
    "config_groups weights a string": _quantization(
        quant_method="compressed-tensors", format="float-quantized", config_groups={"g": {"weights": "x"}}
    ),
    "global_quant_config a list": _quantization(quant_method="quark", global_quant_config=[]),
    "ignore an invalid regex": _quantization(
        quant_method="compressed-tensors",
        format="float-quantized",
        config_groups={"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}},
        ignore=["re:(["],
    ),
    "ignored_layers a number": _quantization(ignored_layers=1.5),
    "hf_quant_config.json not UTF-8": _modelopt_file(b'{"quantization": {"quant_algo": "FP8\xff"}}'),
    "hf_quant_config.json a list": _modelopt_file(b"[1, 2]"),
    "architectures a number": _config(lambda c: c.update(architectures=7)),
    "architectures an object": _config(lambda c: c.update(architectures={"a": 1})),
    "architectures a nested list": _config(lambda c: c.update(architectures=[["Phi3ForCausalLM"]])),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_values_are_one_line_and_exit_3(tmp_path: Path, src: Path, case: str) -> None:
    HOSTILE[case](src)
    before = folder_digest(src)
    assert_clean_failure(run_cli("convert", src, tmp_path / "out", "-q"), tmp_path, src, before, {3})
    inspected = run_cli("inspect", src)
    assert inspected.exit_code in (0, 3) and "Traceback" not in inspected.output


@pytest.mark.parametrize(
    "case",
    ["architectures a number", "architectures an object", "architectures a nested list", "index metadata a list"],
)
def test_verify_with_a_hostile_source_is_one_line(tmp_path: Path, src: Path, case: str) -> None:
    """verify reads SOURCE's config and index itself: the same values give the same one line."""
    out = tmp_path / "ref"
    assert run_cli("convert", EXAMPLE, out, "-q").exit_code == 0
    HOSTILE[case](src)
    result = run_cli("verify", src, out, "-q")
    assert result.exit_code in (1, 3) and "Traceback" not in result.output
    assert result.output.strip().startswith("Error: " if result.exit_code == 3 else "MISMATCH")


@pytest.mark.parametrize(
    "card, warning",
    [
        (b"---\nlicense: [mit\n---\n\nSome text.\n", "its front matter is not valid YAML"),
        (b"---\n1: one\n2: two\n---\n\nSome text.\n", "its front matter is not a mapping with string keys"),
        (b"---\nlicense: mit\n---\n\nCaf\xe9 text.\n", "not UTF-8"),
    ],
)
def test_a_broken_source_card_converts_with_a_warning(tmp_path: Path, src: Path, card: bytes, warning: str) -> None:
    """The model card is prose, not weights: its text is kept, what cannot be parsed is dropped and said."""
    (src / "README.md").write_bytes(card)
    result = run_cli("convert", src, tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert f"warning: README.md: {warning}" in result.output
    written = (tmp_path / "out" / "README.md").read_text(encoding="utf-8")
    assert "text." in written and written.startswith("---\n")


# --- 3. headers: accepted exactly when safetensors accepts them -----------------------------------------------

GOOD = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
HEADERS: dict[str, bytes] = {
    "plain": GOOD + b"}",
    "UTF-8 BOM": b"\xef\xbb\xbf" + GOOD + b"}",
    "leading space": b" " + GOOD + b"}",
    "UTF-16": (GOOD + b"}").decode().encode("utf-16"),
    "__metadata__ a list": b'{"__metadata__":[],' + GOOD[1:] + b"}",
    "__metadata__ null": b'{"__metadata__":null,' + GOOD[1:] + b"}",
    "__metadata__ integer value": b'{"__metadata__":{"x":1},' + GOOD[1:] + b"}",
    "__metadata__ twice": b'{"__metadata__":{},"__metadata__":{},' + GOOD[1:] + b"}",
    "tensor field twice": b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "tensor twice": GOOD + b',"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata key twice": b'{"__metadata__":{"x":"1","x":"2"},' + GOOD[1:] + b"}",
    "Infinity": GOOD + b',"b":Infinity}',
    "NaN": b'{"__metadata__":{"x":NaN},' + GOOD[1:] + b"}",
    "boolean in shape": b'{"a":{"dtype":"F32","shape":[true,2],"data_offsets":[0,8]}}',
    "boolean offset": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[false,8]}}',
    "float in shape": b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}',
    "exponent in shape": b'{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}',
    "negative zero offset": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}',
    "offset past u64": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}}',
    "extra field": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[1,{"y":null}]}}',
    "extra huge integer": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1' + b"0" * 400 + b"}}",
    "extra 30-digit integer": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1' + b"0" * 30 + b"}}",
    "extra nested 125 deep": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
    + b"[" * 125
    + b"]" * 125
    + b"}}",
    "extra nested 126 deep": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
    + b"[" * 126
    + b"]" * 126
    + b"}}",
    "three offsets": b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}',
    "unknown dtype": b'{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}',
    "lowercase dtype": b'{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}',
    "F4 dtype": b'{"a":{"dtype":"F4","shape":[16],"data_offsets":[0,8]}}',
    "F4 off a byte boundary": b'{"a":{"dtype":"F4","shape":[15],"data_offsets":[0,8]}}',
    "C64 dtype": b'{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}',
    "lone surrogate": b'{"a\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "surrogate pair": b'{"a\\ud83d\\ude00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "empty name": b'{"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "tensor null": b'{"a":null,"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "trailing garbage": GOOD + b"} x",
    "trailing NUL": GOOD + b"}\x00",
    "trailing whitespace": GOOD + b"}\t\n\r ",
    "raw control character": b'{"__metadata__":{"x":"a\tb"},' + GOOD[1:] + b"}",
    "escaped NUL": b'{"__metadata__":{"x":"a\\u0000b"},' + GOOD[1:] + b"}",
    "not an object": b"[1]",
    "missing shape": b'{"a":{"dtype":"F32","data_offsets":[0,8]}}',
    "overflowing shape": b'{"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}}',
    "empty tensor beside": b'{"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},' + GOOD[1:] + b"}",
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_headers_are_accepted_exactly_when_safetensors_accepts_them(tmp_path: Path, case: str) -> None:
    body = HEADERS[case]
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\x00" * 8)
    try:
        read_header(path)
        ours = True
    except InvalidCheckpoint as e:
        ours = False
        assert str(e).startswith("x.safetensors: ") and "\n" not in str(e)
    assert ours == safetensors_opens(path)


def test_an_exit_0_conversion_always_opens_with_safe_open(tmp_path: Path, src: Path) -> None:
    """Issue 12 item 3: `"shape": [true, 64]` used to convert and verify, and safe_open refused the output."""
    _header_entry("model.layers.0.input_layernorm.weight", "shape", [True, 64])(src)
    assert not safetensors_opens(src / SHARD1)
    result = run_cli("convert", src, tmp_path / "out", "-q")
    assert result.exit_code == 3 and "invalid shape" in result.output


# --- 4. verify on tampered output ------------------------------------------------------------------------------


def _reshape(name: str, shape: list[int]) -> Callable[[Path], None]:
    def change(out: Path) -> None:
        path = out / shard_files(out)[name]
        header, data = read_raw_header(path)
        header[name]["shape"] = shape
        write_raw(path, header, data)

    return change


TAMPERED: dict[str, Callable[[Path], None]] = {
    "an extra evil.py": lambda out: (out / "evil.py").write_text("import os\n"),
    "an extra .safetensors file": lambda out: shutil.copyfile(out / SHARD1, out / "extra.safetensors"),
    "embed_tokens reshaped": _reshape("model.embed_tokens.weight", [128, 128]),
    "a [] weight scale as [1]": _reshape("model.layers.0.mlp.down_proj.weight_scale", [1]),
    "a [] input scale as [1, 1]": _reshape("model.layers.0.mlp.down_proj.input_scale", [1, 1]),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_verify_refuses_tampered_output(tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    assert run_cli("convert", EXAMPLE, out, "-q", "--format", "keep").exit_code == 0
    TAMPERED[case](out)
    result = run_cli("verify", EXAMPLE, out, "-q")
    assert result.exit_code == 1, result.output
    assert "MISMATCH" in result.output


# --- 5, 6, 9. OUTPUT a link, two writers at once, leftovers of killed runs -----------------------------------


def test_output_that_is_a_link_is_written_at_its_target(tmp_path: Path, src: Path) -> None:
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    assert run_cli("convert", src, link, "-q").exit_code == 0
    assert link.is_symlink() and (link / "config.json").is_file() and (target / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "real", "src"]
    assert run_cli("convert", src, link, "-q", "--overwrite").exit_code == 0
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "real", "src"]


def test_a_second_writer_to_the_same_output_is_refused(tmp_path: Path, src: Path) -> None:
    out = tmp_path / "out"
    with output_lock(out):
        result = run_cli("convert", src, out, "-q")
    assert result.exit_code == 5 and "another fp8fix process is writing it" in result.output  # environment
    assert not out.exists()
    assert run_cli("convert", src, out, "-q").exit_code == 0  # the lock is gone with its holder


def _fp8fix(*args: str | Path, **kwargs: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "FP8FIX_DEBUG"}
    return subprocess.Popen(
        [sys.executable, "-m", "fp8fix", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def test_two_conversions_into_one_new_output_have_one_winner(tmp_path: Path) -> None:
    """Issue 12 item 6: both used to exit 0, the second silently replacing the first."""
    src = build(tmp_path / "src", phi3(hidden=512, intermediate=2048, layers=4), files=2, extra_files=False)
    out = tmp_path / "out"
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        procs = [_fp8fix("convert", src, out, "-q") for _ in range(2)]
        results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
        codes = sorted(code for code, _ in results)
        assert codes[0] == 0 and codes[1] in (5, 2), results  # 5: busy; 2: the winner had finished, not empty
        loser = next(text for code, text in results if code != 0)
        assert "Traceback" not in loser and loser.count("\n") == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_stale_staging_folders_are_removed_by_the_next_run(tmp_path: Path, src: Path) -> None:
    stale = tmp_path / ".out.fp8fix-0123456789ab"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    old = tmp_path / ".out.fp8fix-old-ba9876543210"
    old.mkdir()
    unrelated = tmp_path / ".other.fp8fix-0123456789ab"
    unrelated.mkdir()
    result = run_cli("convert", src, tmp_path / "out", "-q")
    assert result.exit_code == 0
    assert "warning: removed .out.fp8fix-0123456789ab" in result.output
    assert "warning: removed .out.fp8fix-old-ba9876543210" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.fp8fix-0123456789ab", "out", "src"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_after_a_kill_no_staging_folder_survives_the_next_run(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM: cleaned up at once (exit 143). SIGKILL cannot be caught: the next run removes the leftover."""
    src = build(tmp_path / "src", phi3(hidden=1024, intermediate=4096, layers=8), files=4, extra_files=False)
    out = tmp_path / "out"
    proc = _fp8fix("convert", src, out, "-q")
    with stopped_while(proc, lambda: writing(tmp_path, "out", 4)):  # stopped mid-write: no race to lose
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and stderr.strip() == "Terminated: nothing was written.", stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
        return
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert left, "SIGKILL left nothing to clean up"
    rerun = run_cli("convert", src, out, "-q")
    assert rerun.exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert "interrupted run" in rerun.output


# --- 7. Ctrl-C before any command runs; a bug is one line ------------------------------------------------------


@pytest.mark.parametrize("during", ["entry imports", "import", "option parsing"])
def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path: Path, during: str) -> None:
    """Issue 12 item 7, made deterministic: the interrupt is raised while the CLI module is imported
    (what a Ctrl-C in the first ~0.1 s hits) or while click runs an option callback; issue 48: a real SIGINT
    while the entry point imports fp8fix.errors (dataclasses, inspect: 20 ms), before `run` holds its guards."""
    hook = {
        "entry imports": "import builtins, os, signal; real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name == 'fp8fix.errors': os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n",
        "import": "import builtins; real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name == 'fp8fix.cli': raise KeyboardInterrupt\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n",
        "option parsing": "import fp8fix.registry.architectures as r\n"
        "def boom(*a, **k): raise KeyboardInterrupt\n"
        "r.Registry.builtin = boom\n",
    }[during]
    code = (
        hook + f"import sys; sys.argv = ['fp8fix', 'inspect', {str(EXAMPLE)!r}]\nfrom fp8fix.entry import run; run()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "Interrupted: nothing was written."  # click writes a newline first on Ctrl-C


def test_a_bug_is_one_line_and_exit_70(tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fp8fix.conversion

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a planted bug")

    monkeypatch.setattr(fp8fix.conversion, "plan_for_target", broken)
    monkeypatch.delenv("FP8FIX_DEBUG", raising=False)
    result = run_cli("convert", src, tmp_path / "out", "-q")
    assert result.exit_code == 70
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert "Internal error" in result.output and "ZeroDivisionError: a planted bug" in result.output


# --- 8. SOURCE truncated mid-run ------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [["--to", "e4m3fnuz"], ["--layout", "unfused"]])
def test_a_source_truncated_mid_run_is_one_clear_error(tmp_path: Path, options: list[str]) -> None:
    """Issue 12 item 8: a memory-mapped read of a file that shrank died of SIGBUS. The shard is truncated
    after planning, just before the writer reads it (in a subprocess: a SIGBUS would kill pytest)."""
    src = build(tmp_path / "src", phi3(hidden=256, intermediate=1024), files=1, extra_files=False)
    shard = next(src.glob("*.safetensors"))
    code = (
        "import os, sys\n"
        "import fp8fix.conversion as c\n"
        "real = c.write_plan\n"
        "def truncating(plan, out_dir, **options):\n"
        f"    os.truncate({str(shard)!r}, os.path.getsize({str(shard)!r}) // 2)\n"
        "    return real(plan, out_dir, **options)\n"
        "c.write_plan = truncating\n"
        f"sys.argv = ['fp8fix', 'convert', {str(src)!r}, {str(tmp_path / 'out')!r}, '-q', *{options!r}]\n"
        "from fp8fix.entry import run; run()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FP8FIX_DEBUG"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 5, proc.stderr  # environment: not the model's fault, nor the command's
    assert proc.stderr.count("\n") == 1 and "another process is changing SOURCE" in proc.stderr
    assert shard.name in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# --- 10. said out loud: tensors missing from the index, a wrong total_size -------------


def test_checkpoint_oddities_are_warned_about(tmp_path: Path, src: Path) -> None:
    """(A shard linked from outside SOURCE was a warning here; issue 25 refuses it: tests/test_hostile_repos.py.)"""
    edit_json(src / INDEX, lambda idx: idx["weight_map"].pop("model.norm.weight") and None)
    edit_json(src / INDEX, lambda idx: idx["metadata"].update(total_size=12))
    result = run_cli("convert", src, tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert "missing from its weight_map" in result.output
    assert "total_size 12 is not the" in result.output
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    written = sum((tmp_path / "out" / f).stat().st_size for f in set(index["weight_map"].values()))
    assert 0 < index["metadata"]["total_size"] < written
    assert set(index["weight_map"]) == set(shard_files(tmp_path / "out")) and len(index["weight_map"]) == sum(
        len(safe_open(tmp_path / "out" / f, framework="pt").keys()) for f in set(index["weight_map"].values())
    )
    inspected = run_cli("inspect", src)
    assert "total_size 12" in inspected.output
