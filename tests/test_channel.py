"""--layout channel: every weight scale per row ([out, 1]), the FP8 codes byte-identical, written as
compressed-tensors; exact where `fused` requantizes (issue 14). Real loaders: tests/loaders."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from tests.builders import FP8, Model, build, phi3
from tests.conftest import load_tensors, patch_bytes, raw, run_cli

#: Sources the channel layout is written from: builder format -> the scale key of its input scales.
SOURCES = {
    "fp8": "input_scale",
    "fp8-legacy": "act_scale",
    "compressed-tensors": "input_scale",
    "quark": "input_scale",
    "modelopt": "input_scale",
}


def row_scales(model: Model, module: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """The scale of every row of `module`, from the source's scale, by the builder's own shard row counts."""
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).float()
    counts = next(f.rows for f in model.fused if module.endswith(f.suffix))
    return torch.cat([scale[i].expand(n) for i, n in enumerate(counts)]).float()


def convert_channel(tmp_path: Path, fmt: str, *options: str) -> tuple[Path, Path, Model]:
    model = phi3()
    src = build(tmp_path / "src", model, fmt=fmt, scale="shard")
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--layout", "channel", "--json", "-q", *options)
    assert result.exit_code == 0, result.output
    return src, out, model


@pytest.mark.parametrize("fmt", list(SOURCES))
def test_codes_identical_and_each_row_keeps_its_shard_scale(tmp_path: Path, fmt: str) -> None:
    src, out, model = convert_channel(tmp_path, fmt)
    s, o = load_tensors(src), load_tensors(out)
    weights = [n for n, t in s.items() if t.dtype == FP8]
    assert len(weights) == 8
    for name in weights:
        module = name.removesuffix(".weight")
        assert raw(o[name]) == raw(s[name])  # not one code changed
        scale = o[module + ".weight_scale"]
        rows = s[name].shape[0]
        assert scale.shape == (rows, 1) and scale.dtype == s[module + ".weight_scale"].dtype
        assert torch.equal(scale.reshape(-1).float(), row_scales(model, module, s[module + ".weight_scale"], rows))
        # one static input scale per module: the largest of its shards', as every runtime takes it
        source_input = s[f"{module}.{SOURCES[fmt]}"].float()
        assert o[module + ".input_scale"].shape == (1,)
        assert float(o[module + ".input_scale"]) == float(source_input.max())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["targets"] == ["Linear"]
    assert group["input_activations"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
    }
    if fmt == "fp8-legacy":  # legacy names become the current ones
        assert "model.layers.0.self_attn.k_scale" in o and not any(n.endswith("act_scale") for n in o)


def test_e4m3fnuz_composes_rows_doubled_exactly(tmp_path: Path) -> None:
    src, out, model = convert_channel(tmp_path, "fp8", "--to", "e4m3fnuz")
    s, o = load_tensors(src), load_tensors(out)
    name = "model.layers.1.self_attn.qkv_proj"
    codes = s[name + ".weight"].view(torch.uint8)
    assert torch.equal(o[name + ".weight"].view(torch.uint8), torch.where(codes == 0x80, 0, codes))
    expected = row_scales(model, name, s[name + ".weight_scale"], codes.shape[0]) * 2
    assert torch.equal(o[name + ".weight_scale"].reshape(-1), expected)


def test_verify_fails_when_one_row_scale_changes(tmp_path: Path) -> None:
    src, out, _ = convert_channel(tmp_path, "fp8")
    assert run_cli("verify", src, out).exit_code == 0
    name = "model.layers.0.mlp.gate_up_proj.weight_scale"
    patch_bytes(out, name, {4 * 200: 0x01})  # row 200 (an up row): the lowest mantissa bit of its scale
    result = run_cli("verify", src, out, "--json")
    assert result.exit_code == 1
    assert any("gate_up_proj" in p for p in json.loads(result.stdout)["problems"])


@pytest.mark.parametrize("target", ["auto", "vllm", "transformers"])
def test_channel_is_the_default_when_shard_scales_differ(tmp_path: Path, target: str) -> None:
    """Exact beats requantized: with different shard scales every other layout is requantized, by fp8fix
    (fused) or by the runtime at load (unfused), so the loaders' targets pick channel."""
    src = build(tmp_path / "src", phi3(), scale="shard")
    result = run_cli("convert", src, tmp_path / "out", "--target", target, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "channel"


def test_channel_is_not_chosen_where_nothing_is_lost(tmp_path: Path) -> None:
    """Equal shard scales, or one scale per module: no layout requantizes, so the usual ties decide."""
    src = build(tmp_path / "src", phi3(), scale="shard")
    for layer in (0, 1):
        for module, count in (("self_attn.qkv_proj", 3), ("mlp.gate_up_proj", 2)):
            equal = struct.pack(f"<{count}f", *[0.01] * count)
            patch_bytes(src, f"model.layers.{layer}.{module}.weight_scale", dict(enumerate(equal)))
    result = run_cli("convert", src, tmp_path / "out", "--dry-run", "--json")
    assert json.loads(result.stdout)["layout"] != "channel"
    tensor = build(tmp_path / "tensor", phi3())
    assert json.loads(run_cli("convert", tensor, tmp_path / "o2", "--dry-run", "--json").output)["layout"] != "channel"


@pytest.mark.parametrize(
    "fmt, options, message",
    [
        ("fp8", ("--format", "keep"), "use --format compressed-tensors"),
        ("fbgemm", ("--format", "keep"), "vLLM refuses FBGEMM FP8 (per-row) whatever its scales"),
        ("block-fp8", (), "the channel layout is written as compressed-tensors"),
    ],
)
def test_channel_refusals_say_why(tmp_path: Path, fmt: str, options: tuple[str, ...], message: str) -> None:
    scale = "block" if fmt.startswith("block") else "channel" if fmt == "fbgemm" else "shard"
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale=scale)
    result = run_cli("convert", src, tmp_path / "out", "--layout", "channel", *options)
    assert result.exit_code == 3 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["modelopt"])
def test_fnmatch_exclusions_become_ignore_entries_matching_the_same_modules(tmp_path: Path, fmt: str) -> None:
    """ModelOpt's fnmatch lists, written as compressed-tensors `ignore`: by meaning, as the exact names of
    the checkpoint's modules that vLLM's fnmatch reading of the list names (issue 25 W3), never as text."""
    import fnmatch

    patterns = ["lm_head", "*.mlp.down_proj", "model.layers.?.self_attn.o_proj", "*layers.1.*"]
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale="shard", ignore=patterns)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--layout", "channel", "-q").exit_code == 0
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    tensors = load_tensors(src)
    linears = {n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2}
    named = {m for m in linears if any(fnmatch.fnmatchcase(m, p) for p in patterns)}
    assert {"lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.qkv_proj"} <= named
    assert not any(e.startswith("re:") for e in ignore) and set(ignore) >= named
    assert set(ignore) - named <= linears  # anything more is a Linear holding no FP8 weight (ignore_linears)


def test_quark_per_layer_overrides_are_refused(tmp_path: Path) -> None:
    """One compressed-tensors group cannot say Quark's per-layer configs: refused, nothing written."""
    src = build(tmp_path / "src", phi3(), fmt="quark", scale="shard")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["layer_quant_config"] = {"*down_proj": {"weight": None}}
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out", "--layout", "channel")
    assert result.exit_code == 3 and "one compressed-tensors group can describe" in result.output


def test_dynamic_activations_are_written_per_token(tmp_path: Path) -> None:
    """AutoFP8 `activation_scheme: dynamic` has no input scales: compressed-tensors' dynamic per-token
    input activations (llm-compressor's FP8_DYNAMIC), channel weights."""
    src = build(tmp_path / "src", phi3(), scale="shard", static_input=False)
    assert run_cli("convert", src, tmp_path / "out", "--layout", "channel", "-q").exit_code == 0
    group = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert group["group_0"]["input_activations"]["strategy"] == "token"
    assert group["group_0"]["input_activations"]["dynamic"] is True
    assert not any(n.endswith("input_scale") for n in load_tensors(tmp_path / "out"))


def test_quark_exclusions_are_carried_by_meaning(tmp_path: Path) -> None:
    """vLLM reads Quark's `exclude` exactly or, after `re:`, as a Python regex from the start; a shell glob
    names nothing. compressed-tensors' `ignore` gets the exact names those entries name (issue 25 W3)."""
    import re

    entries = ["lm_head", r"re:model\.layers\.1\..*", "*.mlp.down_proj"]
    src = build(tmp_path / "src", phi3(), fmt="quark", scale="shard", ignore=entries)
    assert run_cli("convert", src, tmp_path / "out", "--layout", "channel", "-q").exit_code == 0
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    tensors = load_tensors(src)
    linears = [n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2]
    expected = [m for m in linears if m == "lm_head" or re.match(r"model\.layers\.1\..*", m)]
    assert "model.layers.0.mlp.down_proj" not in ignore  # the glob named nothing
    assert sorted(ignore) == sorted(expected) and len(expected) >= 3
