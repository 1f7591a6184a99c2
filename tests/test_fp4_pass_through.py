"""Mixed FP8 / FP4 checkpoints through FP8 conversions (issue 49): the FP8 parts converted as any FP8 checkpoint's,
the FP4 modules (NVFP4, MXFP4) copied byte for byte and declared by OUTPUT's config as by SOURCE's.

Checkpoints as llm-compressor writes them (`tests.builders.fp4_compressed_tensors`: a config group per scheme,
`format: mixed-precision`). What OUTPUT must hold is worked out here from SOURCE's bytes: FP4 tensors equal,
the FP4 config groups equal, the FP8 values (torch's own e4m3fn / e4m3fnuz decoding times the scales) equal.
A conversion that would move or re-declare an FP4 module is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.checkpoint import CONFIG, open_checkpoint
from fp8fix.model import describe_checkpoint
from fp8fix.plan.fp4_kept import check_fp4_kept
from fp8fix.plan.target_plan import plan_for_target
from fp8fix.registry.architectures import Registry
from fp8fix.registry.formats import matches, name_matcher, pattern_error
from fp8fix.vocab import Grammar
from tests.builders import fp4_compressed_tensors, llama, phi3
from tests.conftest import load_tensors, run_cli

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
#: Phi-3's fused modules by their on-disk names: FP8 MLP, MXFP4 attention (the fused qkv_proj among them)
PHI3_MXFP4_ATTENTION = {"qkv_proj": "mxfp4", "o_proj": "mxfp4", "gate_up_proj": "fp8", "down_proj": "fp8"}
#: FP8_BLOCK MLP (128 x 128 blocks) beside MXFP4 attention, on a model whose MLP a TP of 2 does not split whole
BLOCK_MLP_MXFP4_ATTENTION = {**dict.fromkeys(ATTENTION, "mxfp4"), **dict.fromkeys(MLP, "fp8block")}
#: NVFP4 attention beside FP8 (a scale per row) MLP
NVFP4_ATTENTION = {**dict.fromkeys(ATTENTION, "nvfp4"), **dict.fromkeys(MLP, "fp8")}
FP4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")


def fp4_groups(folder: Path) -> dict[str, object]:
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    return {k: g for k, g in qc["config_groups"].items() if g["format"].endswith("pack-quantized")}


def fp4_tensors(tensors: dict[str, torch.Tensor], modules: set[str]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in tensors.items() if n.endswith(FP4_SUFFIXES) and n.rpartition(".")[0] in modules}


def fp4_modules(tensors: dict[str, torch.Tensor]) -> set[str]:
    return {n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")}


def fp8_values(tensors: dict[str, torch.Tensor], module: str, encoding: torch.dtype) -> torch.Tensor:
    """float64 [out, in]: codes read as `encoding` by torch, times their per-row scales."""
    codes = tensors[f"{module}.weight"].view(encoding).to(torch.float64)
    return codes * tensors[f"{module}.weight_scale"].to(torch.float64)


def assert_fp4_passed_through(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """OUTPUT holds every FP4 tensor of SOURCE byte for byte, its FP4 config groups, and no FP4 module in `ignore`."""
    before, after = load_tensors(src), load_tensors(out)
    modules = fp4_modules(before)
    assert modules and fp4_modules(after) == modules
    kept = fp4_tensors(before, modules)
    assert fp4_tensors(after, modules).keys() == kept.keys()
    for name, t in kept.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    assert fp4_groups(out) == fp4_groups(src) != {}
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not modules & set(ignore)
    return after


def test_an_encoding_change_converts_the_fp8_modules_and_keeps_mxfp4_ones(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", PHI3_MXFP4_ATTENTION, phi3())
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--to", "e4m3fnuz", "--layout", "fused")
    assert result.exit_code == 0, result.output
    after = assert_fp4_passed_through(src, out)
    before = load_tensors(src)
    for layer in range(2):
        for proj in ("mlp.gate_up_proj", "mlp.down_proj"):
            module = f"model.layers.{layer}.{proj}"
            expected = fp8_values(before, module, torch.float8_e4m3fn)
            assert torch.equal(fp8_values(after, module, torch.float8_e4m3fnuz), expected), module


def test_unfusing_splits_the_fp8_modules_and_leaves_a_fused_fp4_module_fused(tmp_path: Path) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", PHI3_MXFP4_ATTENTION, phi3())
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--layout", "unfused")
    assert result.exit_code == 0, result.output
    after = assert_fp4_passed_through(src, out)
    before = load_tensors(src)
    fused = fp8_values(before, "model.layers.0.mlp.gate_up_proj", torch.float8_e4m3fn)
    gate = fp8_values(after, "model.layers.0.mlp.gate_proj", torch.float8_e4m3fn)
    up = fp8_values(after, "model.layers.0.mlp.up_proj", torch.float8_e4m3fn)
    assert torch.equal(torch.cat([gate, up]), fused)
    assert "model.layers.0.self_attn.qkv_proj.weight_packed" in after


@pytest.mark.parametrize(
    ("schemes", "options"),
    [
        (BLOCK_MLP_MXFP4_ATTENTION, ["--scales", "ue8m0"]),
        (NVFP4_ATTENTION, ["--dequantize", "*.down_proj"]),
        (NVFP4_ATTENTION, []),
    ],
)
def test_other_fp8_conversions_pass_fp4_modules_through(
    tmp_path: Path, schemes: dict[str, str], options: list[str]
) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", schemes, llama(hidden=128, intermediate=192))
    out = tmp_path / "out"
    result = run_cli("convert", src, out, *options)  # (run_cli verifies every conversion it makes)
    assert result.exit_code == 0, result.output
    assert_fp4_passed_through(src, out)


@pytest.mark.parametrize(
    ("schemes", "options", "said"),
    [
        (NVFP4_ATTENTION, ["--to", "e4m3fnuz"], "their scales are e4m3fn values"),
        (BLOCK_MLP_MXFP4_ATTENTION, ["--tp", "2"], "would make config.json say intermediate_size 256"),
        (BLOCK_MLP_MXFP4_ATTENTION, ["--blocks", "mx"], "would change how config.json declares FP4 module"),
    ],
)
def test_conversions_that_would_misdeclare_fp4_modules_are_refused(
    tmp_path: Path, schemes: dict[str, str], options: list[str], said: str
) -> None:
    src = fp4_compressed_tensors(tmp_path / "src", schemes, llama(hidden=128, intermediate=192))
    result = run_cli("convert", src, tmp_path / "out", *options)
    assert result.exit_code == 3, result.output
    assert said in result.output and "--to bf16" in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_the_check_refuses_any_plan_that_moves_or_redeclares_an_fp4_module(tmp_path: Path) -> None:
    """The check runs on the finished plan, whatever planned it: a planner that dropped an FP4 group, or wrote an
    FP4 tensor from other bytes, is caught before anything is written."""
    src = fp4_compressed_tensors(tmp_path / "src", NVFP4_ATTENTION)
    model = describe_checkpoint(open_checkpoint(src), Registry.builtin())
    plan = plan_for_target(model, "fused")
    check_fp4_kept(plan, model)  # as planned: passes

    config = json.loads((src / CONFIG).read_text())
    groups = config["quantization_config"]["config_groups"]
    groups.pop(next(k for k, g in groups.items() if g["format"] == "nvfp4-pack-quantized"))
    plan.config_files[CONFIG] = (config, [])
    with pytest.raises(UnsupportedCheckpoint, match="declares FP4 module"):
        check_fp4_kept(plan, model)

    plan = plan_for_target(model, "fused")
    packed = next(t for s in plan.shards for t in s.tensors if t.name.endswith(".weight_packed"))
    other = next(t for s in plan.shards for t in s.tensors if t.name.endswith("input_layernorm.weight"))
    packed.pieces = list(other.pieces)
    with pytest.raises(UnsupportedCheckpoint, match=f"rewrite or rename '{packed.name}'"):
        check_fp4_kept(plan, model)


def test_verify_catches_an_fp4_group_output_lost(tmp_path: Path) -> None:
    """verify reads OUTPUT's config against SOURCE's itself: an FP4 group gone (its modules read as unquantized) is
    a problem, whatever convert wrote."""
    src = fp4_compressed_tensors(tmp_path / "src", NVFP4_ATTENTION)
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--dequantize", "*.down_proj").exit_code == 0
    config = json.loads((out / CONFIG).read_text())
    groups = config["quantization_config"]["config_groups"]
    groups.pop(next(k for k, g in groups.items() if g["format"] == "nvfp4-pack-quantized"))
    (out / CONFIG).write_text(json.dumps(config))
    checked = run_cli("verify", src, out)
    assert checked.exit_code == 1 and "quantization_config differs from SOURCE's" in checked.output, checked.output


@pytest.mark.parametrize("grammar", ["exact", "exact-or-re", "transformers", "fnmatch", "quark-layer"])
def test_one_matcher_for_many_entries_names_what_each_entry_names(grammar: Grammar) -> None:
    """`name_matcher` (plain entries at once, with Python's re) against `matches` entry by entry, over names and
    entries chosen to differ by a boundary, a suffix, a wildcard and a regex."""
    entries = [
        "model.layers.0.mlp",
        "lm_head",
        "layers.1.attn.wq_a",
        "re:.*q_proj$",
        "re:model.layers.1",
        "*.down_proj",
        "mlp.up",
        "model.layers.1.self_attn.q_proj.extra",
    ]
    names = [
        "model.layers.0.mlp",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlpx.gate_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.10.mlp.down_proj",
        "layers.1.attn.wq_a",
        "layers.1.attn.wq_ab",
        "lm_head",
        "model.lm_head",
        "model.layers.0.mlp.up",
        "model.layers.0.mlp.upper",
    ]
    if grammar == "transformers":  # its entries are regexes: config checks refuse one that does not compile
        entries = [e for e in entries if pattern_error(e) is None]
    for chosen in (entries, entries[:1], entries[3:5], entries[5:]):
        named = name_matcher(chosen, grammar)
        for name in names:
            assert named(name) == any(matches(e, name, grammar) for e in chosen), (chosen, name)
