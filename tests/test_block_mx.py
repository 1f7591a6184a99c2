"""`convert --blocks mx` (issue 49): block FP8 written as compressed-tensors MXFP8, for GPUs with MX kernels.

What is asserted, each from outside the code under test:
- every OUTPUT value, decoded from the OCP MX definition (tests/test_mx_numerics.py's E8M0 decoder, torch's own
  e4m3fn values), is SOURCE's code x block scale exactly where that scale is a power of two (UE8M0 scales, as
  DeepSeek-V3.1 ships), and otherwise what `--scales ue8m0`'s rule makes of the block (tests/test_ue8m0.py's
  reference, written apart from fp8fix);
- every 32 elements of a block's rows carry the block's one E8M0 byte; the config is llm-compressor's MXFP8
  preset; SOURCE's codes are kept byte for byte where they can be;
- OUTPUT read back as MXFP8 by fp8fix (`--blocks 128x128`) gives SOURCE's values again, every block exact;
- the rows convert prints are what inspect says of OUTPUT (the measured MXFP8 rows: tests/loaders);
- verify catches a changed code and a block whose bytes differ; what MXFP8 cannot hold is refused, named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import block_fp8_checkpoint, build, glm, llama, mimo_v2, mlp_linears, phi3
from tests.conftest import run_cli
from tests.test_mx_formats import MEASURED
from tests.test_mx_numerics import spec_e8m0
from tests.test_ue8m0 import reference
from tests.test_unquantized import tampered, tensors_of


def source_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    """Each block of SOURCE: (row slice, column slice, its exact values in float64, its scale)."""
    rows, cols = weight.shape
    values = weight.view(torch.float8_e4m3fn).double()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, c = (
                slice(i * block[0], min(rows, (i + 1) * block[0])),
                slice(j * block[1], min(cols, (j + 1) * block[1])),
            )
            s = float(scale[i, j].float())
            yield r, c, values[r, c] * s, s


def mx_values(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """OUTPUT's value of every element: the e4m3fn value times 2^(b - 127) of its group of 32 (OCP MX)."""
    powers = torch.tensor([[spec_e8m0(b) for b in row] for row in scale.tolist()], dtype=torch.float64)
    return weight.view(torch.float8_e4m3fn).double() * powers.repeat_interleave(32, dim=1)


def check_output(src: Path, out: Path, block: tuple[int, int]) -> tuple[int, int]:
    """Every weight of OUTPUT against SOURCE block by block (the module docstring); (blocks kept, requantized)."""
    source, output = tensors_of(src), tensors_of(out)
    kept = requantized = 0
    for name in [n for n in source if n.endswith(".weight_scale_inv")]:
        module = name.removesuffix(".weight_scale_inv")
        weight, scale = output[f"{module}.weight"], output[f"{module}.weight_scale"]
        assert scale.dtype == torch.uint8 and scale.shape == (weight.shape[0], weight.shape[1] // 32), module
        assert f"{module}.weight_scale_inv" not in output
        got = mx_values(weight, scale)
        for r, c, v, s in source_blocks(source[f"{module}.weight"], source[name], block):
            assert len(set(scale[r, c.start // 32 : -(-c.stop // 32)].flatten().tolist())) == 1, (module, r, c)
            new_scale, new_codes = reference(v, s)
            assert torch.equal(got[r, c], new_codes * new_scale), (module, r, c)
            if new_scale == s:
                kept += 1
                assert torch.equal(
                    output[f"{module}.weight"][r, c].view(torch.uint8),
                    source[f"{module}.weight"][r, c].view(torch.uint8),
                )
            else:
                requantized += 1
    return kept, requantized


@pytest.mark.parametrize(("fmt", "model"), [("block-fp8-e8m0", phi3), ("block-fp8-e8m0", llama), ("block-fp8", llama)])
def test_each_value_is_the_source_value_or_the_ue8m0_rule(tmp_path: Path, fmt: str, model) -> None:
    src = build(tmp_path / "src", model(), fmt=fmt, kv_scales=False)
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "mx", "--json")  # verify runs too (run_cli)
    assert result.exit_code == 0, result.output
    kept, requantized = check_output(src, tmp_path / "out", (32, 32))
    report = json.loads(result.output)
    modules = report["ue8m0"]["modules"]
    assert report["ue8m0"]["mx"] is True and report["ue8m0"]["scale_fmt"] is False
    assert all(m["vllm_max_steps"] is None for m in modules)  # worked out for --scales ue8m0 only
    assert (sum(m["blocks_kept"] for m in modules), sum(m["blocks_requantized"] for m in modules)) == (
        kept,
        requantized,
    )
    if fmt == "block-fp8-e8m0":  # powers of two already: nothing moves
        assert requantized == 0 and kept > 0
    else:
        assert requantized > 0
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "mxfp8-quantized", ["lm_head"])
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"]["dynamic"] is True
    assert {k: group["weights"][k] for k in ("type", "num_bits", "strategy", "group_size", "scale_dtype")} == {
        "type": "float", "num_bits": 8, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"
    }  # fmt: skip
    # the rows convert printed are inspect's of OUTPUT, and the measured MXFP8 rows
    rows = json.loads(run_cli("inspect", tmp_path / "out", "--json").output)["loaders"]
    assert {r: v["verdict"] for r, v in rows.items()} == {r: v["verdict"] for r, v in report["loaders"].items()}
    assert {r: v["verdict"] for r, v in rows.items()} == MEASURED


def test_a_compressed_tensors_block_source_keeps_its_targets_and_ignore(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), fmt="ct-block", kv_scales=False, ignore=["lm_head", "re:.*unused"])
    assert run_cli("convert", src, tmp_path / "out", "--blocks", "mx").exit_code == 0
    before = json.loads((src / "config.json").read_text())["quantization_config"]
    after = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert after["format"] == "mxfp8-quantized" and after["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert after["ignore"] == before["ignore"] == ["lm_head", "re:.*unused"]
    assert after["config_groups"]["group_0"]["targets"] == before["config_groups"]["group_0"]["targets"]
    assert tensors_of(tmp_path / "out")["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.uint8


@pytest.mark.parametrize(("fmt", "ignore"), [("ct-block", ["lm_head", "re:.*down_proj"]), ("block-fp8", ["down_proj"])])
def test_a_list_that_leaves_fp8_modules_unquantized_is_refused(tmp_path: Path, fmt: str, ignore: list[str]) -> None:
    """What a loader does with FP8 codes of a module its config leaves unquantized has no MXFP8 form."""
    src = build(tmp_path / "src", llama(), fmt=fmt, kv_scales=False, ignore=ignore)
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "mx")
    assert (
        result.exit_code == 3 and "lists FP8 module(s) as not quantized (model.layers.0.mlp.down_proj" in result.output
    )
    assert not (tmp_path / "out").exists()


def test_mx_output_read_back_at_128_blocks_is_the_source(tmp_path: Path) -> None:
    """A DeepSeek-style checkpoint (F32 128 x 128 scales) -> MXFP8 -> `--blocks 128x128`: every block of the
    last is exact, and its values are those the MXFP8 output holds (SOURCE's, or the ue8m0 rule's)."""
    config = {
        **llama(hidden=256, heads=2, kv_heads=1, intermediate=256, layers=1).config,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    linears = {
        **mlp_linears("model.layers.0.mlp", 256, 256),
        **{f"model.layers.0.self_attn.{p}": (256, 256) for p in ("q_proj", "o_proj")},
        **{f"model.layers.0.self_attn.{p}": (128, 256) for p in ("k_proj", "v_proj")},
    }
    src = block_fp8_checkpoint(tmp_path / "src", config, linears)
    assert run_cli("convert", src, tmp_path / "mx", "--blocks", "mx").exit_code == 0
    check_output(src, tmp_path / "mx", (128, 128))
    result = run_cli("convert", tmp_path / "mx", tmp_path / "back", "--blocks", "128x128", "--json")
    assert result.exit_code == 0, result.output
    assert all(m["blocks_rounded"] == 0 for m in json.loads(result.output)["reblocked"])
    mx, back = tensors_of(tmp_path / "mx"), tensors_of(tmp_path / "back")
    for module in linears:
        grid = back[f"{module}.weight_scale"].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        values = back[f"{module}.weight"].view(torch.float8_e4m3fn).double() * grid
        assert torch.equal(values, mx_values(mx[f"{module}.weight"], mx[f"{module}.weight_scale"])), module


def test_verify_catches_a_moved_code_and_bytes_that_differ_in_a_block(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), fmt="block-fp8", kv_scales=False, files=1)
    assert run_cli("convert", src, tmp_path / "out", "--blocks", "mx").exit_code == 0
    name = "model.layers.1.mlp.up_proj"
    moved = tensors_of(tmp_path / "out")
    moved[f"{name}.weight"].view(torch.uint8)[5, 40] ^= 1
    result = run_cli("verify", src, tampered(tmp_path / "out", tmp_path / "moved", moved))
    assert result.exit_code == 1 and f"'{name}.weight' block row 0 column block 1 row 5 column 8" in result.output
    split = tensors_of(tmp_path / "out")
    split[f"{name}.weight_scale"][3, 1] += 1  # columns 32-63 of row 3 apart from the rest of their block
    result = run_cli("verify", src, tampered(tmp_path / "out", tmp_path / "split", split))
    assert result.exit_code == 1 and "E8M0 bytes differ within one block of SOURCE" in result.output


def test_what_mxfp8_cannot_hold_is_refused_and_nothing_written(tmp_path: Path) -> None:
    per_tensor = build(tmp_path / "fp8", phi3())
    result = run_cli("convert", per_tensor, tmp_path / "out", "--blocks", "mx")
    assert result.exit_code == 3 and "its scales are not per block" in result.output
    with_kv = build(tmp_path / "kv", llama(), fmt="ct-block")
    result = run_cli("convert", with_kv, tmp_path / "out", "--blocks", "mx")
    assert result.exit_code == 3 and "model.layers.0.self_attn.k_scale': a kv-cache scale" in result.output
    result = run_cli("convert", with_kv, tmp_path / "out", "--blocks", "mx", "--layout", "fused")
    assert result.exit_code == 2 and "drop --layout" in result.output
    assert not (tmp_path / "out").exists()


def test_a_power_of_two_outside_e8m0_is_refused_with_its_weight(tmp_path: Path) -> None:
    src = build(tmp_path / "src", llama(), fmt="block-fp8", kv_scales=False, files=1)
    tensors = tensors_of(src)
    name = "model.layers.0.self_attn.o_proj"
    tensors[f"{name}.weight_scale_inv"][0, 0] = 2.0**-140  # an F32 subnormal: a power of two E8M0 has no byte for
    tampered_src = tampered(src, tmp_path / "tiny", tensors)
    result = run_cli("convert", tampered_src, tmp_path / "out", "--blocks", "mx")
    assert result.exit_code != 0 and f"weight '{name}.weight' has no MXFP8 form" in result.output
    assert "2^-140" in result.output and not (tmp_path / "out").exists()


def _deepseek_r1(root: Path) -> Path:
    from tests.test_families import deepseek_r1

    return deepseek_r1(root)


#: Block-FP8 checkpoints of every kind the suite builds: DeepSeek-R1's (MLA, a partial block row, unstacked
#: experts, a BF16 router), MiMo-V2's (fused chunks, each with its own block grid), GLM's and Phi-3's fused
#: modules, BF16 block scales (Qwen3), compressed-tensors block weights.
BREADTH = {
    "deepseek-r1": _deepseek_r1,
    "mimo-v2": lambda root: mimo_v2(root),
    "glm": lambda root: build(root, glm(), fmt="block-fp8", kv_scales=False),
    "phi3-bf16-scales": lambda root: build(root, phi3(), fmt="block-fp8-bf16", kv_scales=False),
    "phi3-ct-block": lambda root: build(root, phi3(), fmt="ct-block", kv_scales=False),
}


#: The kinds whose rows are the MX rules' alone (their architectures' loaders run in the suite; the MXFP8 rows
#: were measured on Llama and Phi-3: tests/loaders); DeepSeek's and MiMo's are their architecture's first (a model
#: class not run here, or none in transformers).
MEASURED_ARCHITECTURES = ("glm", "phi3-bf16-scales", "phi3-ct-block")


@pytest.mark.parametrize("name", BREADTH)
def test_every_block_fp8_kind_converts_verifies_and_says_one_thing(tmp_path: Path, name: str) -> None:
    """verify (run_cli runs it: every block re-derived) passes; the rows convert prints are inspect's of OUTPUT
    and the measured MXFP8 rows; `inspect --strict` of OUTPUT fails exactly as its rows say (no target loads it
    on every row), and verify --json's weights are all kept or requantized, as convert's blocks say."""
    src = BREADTH[name](tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "mx", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {
        r: v["verdict"] for r, v in json.loads(run_cli("inspect", tmp_path / "out", "--json").stdout)["loaders"].items()
    }
    assert rows == {r: v["verdict"] for r, v in report["loaders"].items()}
    if name in MEASURED_ARCHITECTURES:  # the MXFP8 rows measured on these models (tests/loaders)
        assert rows == MEASURED
    # --strict fails exactly where the target's rows do not all load
    for target, said in (
        ("transformers", [rows["transformers"]]),
        ("vllm", [v for r, v in rows.items() if r.startswith("vLLM")]),
    ):
        strict = run_cli("inspect", tmp_path / "out", "--strict", "--target", target)
        assert strict.exit_code == (0 if all(v == "loads" for v in said) else 1), (target, said, strict.output)
    verified = json.loads(run_cli("verify", src, tmp_path / "out", "--json").stdout)
    assert verified["ok"] is True
    requantized = sum(m["blocks_requantized"] for m in report["ue8m0"]["modules"])
    kinds = {w["kind"] for w in verified["weights"]}
    assert kinds == ({"exact", "requantized"} if requantized else {"exact"}) or kinds == {"requantized"}


def test_weights_of_one_block_read_as_a_single_scale_convert_too(tmp_path: Path) -> None:
    """A weight no bigger than one 128 x 128 block has a [1, 1] grid, which reads like one scale per tensor: it is
    one block all the same, and written as one (every value checked as for the others)."""
    config = {
        **llama(hidden=96, heads=1, kv_heads=1, intermediate=128, layers=1).config,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    linears = {
        **mlp_linears("model.layers.0.mlp", 128, 96),
        **{f"model.layers.0.self_attn.{p}": (96, 96) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    }
    src = block_fp8_checkpoint(tmp_path / "src", config, linears)
    result = run_cli("convert", src, tmp_path / "out", "--blocks", "mx", "--json")
    assert result.exit_code == 0, result.output
    kept, requantized = check_output(src, tmp_path / "out", (128, 128))
    assert (kept, requantized) == (0, len(linears))  # absmax / 448 scales: none a power of two
