"""Every FP8 format fp8fix converts, each built as its exporter writes it (tests/builders.py FORMATS),
converted with every layout and --to that applies, checked by value here and by `fp8fix verify`
(conftest.run_cli verifies every conversion)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FORMATS, build, phi3
from tests.conftest import load_tensors, raw, run_cli
from tests.test_convert_layouts import UNFUSED, fused_modules

CASES = [
    ("fp8-legacy", "tensor"),
    ("block-fp8", "tensor"),
    ("block-fp8-e8m0", "tensor"),
    ("ct-block", "tensor"),
    ("quark", "tensor"),
    ("quark", "channel"),
    ("modelopt", "tensor"),
    ("fbgemm", "channel"),
]


def element_scales(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, shards: list[int] | None = None
) -> torch.Tensor:
    """One float32 scale per weight element, from the documented shape conventions."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(weight.shape)
    if shards and s.shape == (len(shards),):  # one scale per fused shard
        return s.repeat_interleave(torch.tensor(shards)).reshape(-1, 1).expand(weight.shape)
    if block and s.dim() == 2 and s.shape[1] > 1:
        return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: weight.shape[0], : weight.shape[1]]
    return s.reshape(-1, 1).expand(weight.shape)


def values(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, shards: list[int] | None = None
) -> torch.Tensor:
    return weight.float() * element_scales(weight, scale, block, shards) + 0.0  # + 0.0: -0 and +0 alike


def rows_of(o: dict, module: str, suffix: str, scale_name: str, layout: str) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The output weight rows of a source module and their element scales' source (tensors to concatenate)."""
    if layout == "unfused" and suffix in UNFUSED:
        names = [module.replace(suffix, u) for u in UNFUSED[suffix]]
        return [o[f"{n}.weight"] for n in names], [o[f"{n}.{scale_name}"] for n in names], names
    return [o[f"{module}.weight"]], [o[f"{module}.{scale_name}"]], [module]


@pytest.mark.parametrize("to", [None, "e4m3fnuz"])
@pytest.mark.parametrize("layout", ["unfused", "per-shard", "fused"])
@pytest.mark.parametrize("fmt,scale", CASES)
def test_every_format_every_layout(tmp_path: Path, fmt: str, scale: str, layout: str, to: str | None) -> None:
    spec = FORMATS[fmt]
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale=scale)
    args = ["convert", src, tmp_path / "out", "--layout", layout, "-q"] + (["--to", to] if to else [])
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    factor = 2.0 if to else 1.0
    for module, f in fused_modules():
        weights, scales, _ = rows_of(o, module, f.suffix, spec.weight_scale, layout)
        expected = values(s[f"{module}.weight"], s[f"{module}.{spec.weight_scale}"], spec.block)
        start = 0
        for w, sc in zip(weights, scales, strict=True):
            n = w.shape[0]
            if to:
                assert w.dtype == torch.float8_e4m3fnuz
            got = values(w, sc, spec.block, f.rows if len(weights) == 1 else None)
            part = expected[start : start + n] if len(weights) > 1 else expected
            assert raw(got) == raw(part), f"{module}: values differ"
            start += n
        if spec.input_scale and layout == "unfused":
            src_in = s[f"{module}.{spec.input_scale}"].float() * factor
            for name in rows_of(o, module, f.suffix, spec.weight_scale, layout)[2]:
                assert torch.equal(o[f"{name}.{spec.input_scale}"].float().reshape(-1), src_in.reshape(-1))
    for kv in spec.kv:
        name = f"model.layers.0.self_attn.{kv}"
        assert raw(o[name]) == raw(s[name]), "kv-cache scales never change"


def test_e8m0_block_scales_double_by_their_exponent_byte(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="block-fp8-e8m0")
    assert run_cli("convert", src, tmp_path / "out", "--layout", "fused", "--to", "e4m3fnuz", "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    name = "model.layers.0.self_attn.qkv_proj.weight_scale_inv"
    assert o[name].dtype == torch.float8_e8m0fnu
    assert torch.equal(o[name].view(torch.uint8), s[name].view(torch.uint8) + 1)
    assert (
        run_cli("convert", tmp_path / "out", tmp_path / "back", "--layout", "fused", "--to", "e4m3fn", "-q").exit_code
        == 0
    )
    assert raw(load_tensors(tmp_path / "back")[name]) == raw(s[name])


def test_block_rows_are_sliced(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="ct-block")
    assert run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    grid = s["model.layers.0.self_attn.qkv_proj.weight_scale"]  # [128 / 32, 64 / 32]
    assert grid.shape == (4, 2)
    assert raw(o["model.layers.0.self_attn.q_proj.weight_scale"]) == raw(grid[0:2])
    assert raw(o["model.layers.0.self_attn.k_proj.weight_scale"]) == raw(grid[2:3])
    assert raw(o["model.layers.0.self_attn.v_proj.weight_scale"]) == raw(grid[3:4])


@pytest.mark.parametrize(
    "fmt,entries,where",
    [
        (
            "modelopt",
            ["lm_head", "*layers.1.mlp.gate_up_proj"],
            ("hf_quant_config.json", "quantization", "exclude_modules"),
        ),
        # vLLM's Quark reads `exclude` as exact names or `re:` patterns (quark/utils.py should_ignore_layer)
        ("quark", ["lm_head", r"re:.*\.1\.mlp\.gate_up_proj"], ("config.json", "quantization_config", "exclude")),
        (
            "fbgemm",
            ["lm_head", "layers.1.mlp.gate_up_proj"],
            ("config.json", "quantization_config", "modules_to_not_convert"),
        ),
        (
            "block-fp8",  # transformers: a regex from the start to a module boundary, or a suffix
            ["lm_head", "layers.1.mlp.gate_up_proj"],
            ("config.json", "quantization_config", "modules_to_not_convert"),
        ),
    ],
)
def test_name_lists_follow_the_split_in_each_grammar(
    tmp_path: Path, fmt: str, entries: list[str], where: tuple
) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt, ignore=entries)
    assert run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q").exit_code == 0
    file, *keys = where
    data = json.loads((tmp_path / "out" / file).read_text())
    for key in keys:
        data = data[key]
    shards = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert data == [*entries, *shards]


@pytest.mark.parametrize(
    "fmt, entry, key",
    [
        ("block-fp8", "gate_up", "modules_to_not_convert"),  # a substring, neither prefix nor suffix
        ("quark", "*.1.mlp.gate_up_proj", "exclude"),  # a glob: vLLM's Quark compares it exactly
        ("fp8", "*gate_up_proj", "ignored_layers"),  # AMD's globs: vLLM's fp8 compares them exactly
    ],
)
def test_entries_the_loader_does_not_match_are_left_alone(tmp_path: Path, fmt: str, entry: str, key: str) -> None:
    """A rename edits a list only where the loader reading it matched the fused module: entries it does
    not match (as it matches them, not as a substring or a glob would) gain no shard names."""
    src = build(tmp_path / "src", phi3(), fmt=fmt, ignore=["lm_head", entry])
    assert run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q").exit_code == 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc[key] == ["lm_head", entry]


def test_inspect_knows_each_format(tmp_path: Path) -> None:
    expected = {
        "block-fp8": "block",
        "ct-block": "block",
        "quark": "channel",
        "fbgemm": "channel",
        "modelopt": "tensor",
    }
    for fmt, kind in expected.items():
        scale = "channel" if kind == "channel" else "tensor"
        src = build(tmp_path / fmt, phi3(), fmt=fmt, scale=scale)
        report = json.loads(run_cli("inspect", src, "--json").output)
        assert report["convert_supported"], fmt
        assert {m["scale"] for m in report["modules"]} == {kind}, fmt


#: What the real loaders do with compressed-tensors block FP8 written without input_activations (weight-only,
#: W8A16), measured in tests/loaders/test_real_loaders.py (ct-block-w8a16): SGLang has no scheme for it, the vLLM
#: CPU builds no kernel (not judged: a GPU's is not run), transformers loads it; 0.19 - 0.20 refuse a fused
#: qkv_proj's block scales whatever the kernel.
WEIGHT_ONLY = {
    "llama": {"SGLang 0.5.23": "fails", "vLLM 0.19 - 0.20": "not-judged", "vLLM >= 0.32": "not-judged"},
    "phi3": {"SGLang 0.5.23": "fails", "vLLM 0.19 - 0.20": "fails", "vLLM >= 0.32": "not-judged"},
}


@pytest.mark.parametrize("shape", WEIGHT_ONLY)
def test_weight_only_blocks_are_judged_as_measured(tmp_path: Path, shape: str) -> None:
    from tests.builders import llama

    src = build(tmp_path / "src", llama() if shape == "llama" else phi3(), fmt="ct-block-w8a16")
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert "input_activations" not in qc["config_groups"]["group_0"]
    rows = json.loads(run_cli("inspect", src, "--json").output)["loaders"]
    assert {row: rows[row]["verdict"] for row in WEIGHT_ONLY[shape]} == WEIGHT_ONLY[shape]
    assert rows["transformers"]["verdict"] == "loads"
