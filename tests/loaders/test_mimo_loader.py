"""MiMo-V2.5-Pro-shaped checkpoints through the real vLLM 0.32 loader at tensor-parallel size 1 (issue 15).

fp8fix's unfused output (q_proj / k_proj / v_proj with standard 128x128 block grids) must load into
vLLM's fused qkv_proj with every weight equal to the source's true value (dequantized by this test
from the source files, chunk by chunk, with each chunk's own block grid), except the blocks fp8fix
reported requantized, which must be within half an fp8 step. The source itself loads too: vLLM
regroups the chunks and requantizes every block (the chunk count, 2, is not the TP size, 1), which
this test measures for comparison. fp8fix's verdicts on both must be what the loaders did.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.builders import MIMO_BLOCK, mimo_unfused_rows, mimo_v2
from tests.conftest import run_cli
from tests.loaders.conftest import Loaded, interpreter, run_loader

pytestmark = pytest.mark.loaders

B0, B1 = MIMO_BLOCK
LAYERS = {0: False, 1: True}  # layer -> sliding-window dims (the MTP layer vLLM's main model skips)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def truth_and_mixed(src: Path, layer: int, swa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The true qkv_proj values in vLLM's row order [Q; K; V], and which elements lie in an output block
    that gathers rows of several source blocks (those fp8fix requantizes)."""
    config = json.loads((src / "config.json").read_text())
    s = tensors(src)
    weight = s[f"model.layers.{layer}.self_attn.qkv_proj.weight"].float()
    grid = s[f"model.layers.{layer}.self_attn.qkv_proj.weight_scale_inv"].float()
    values, mixed = [], []
    for shard in range(3):
        rows = mimo_unfused_rows(config, swa, shard)
        per_row = grid[[g for _, g in rows]].repeat_interleave(B1, dim=1)[:, : weight.shape[1]]
        values.append(weight[[r for r, _ in rows]] * per_row)
        block_rows = [len({g for _, g in rows[j : j + B0]}) > 1 for j in range(0, len(rows), B0)]
        mixed.append(torch.tensor(block_rows).repeat_interleave(B0)[: len(rows)])
    return torch.cat(values), torch.cat(mixed).reshape(-1, 1).expand(-1, weight.shape[1])


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Loaded, dict]]:
    interpreter("vllm")
    root = tmp_path_factory.mktemp("mimo-loader")
    src = mimo_v2(root / "src")
    result = run_cli("convert", src, root / "unfused", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    folders = {"source": src, "unfused": root / "unfused"}
    ran = run_loader("vllm", list(folders.values()), root / "vllm")
    return {name: (folder, r, report) for (name, folder), r in zip(folders.items(), ran, strict=True)}


def test_vllm_loads_the_unfused_split_with_the_source_values(loaded: dict[str, tuple[Path, Loaded, dict]]) -> None:
    src = loaded["source"][0]
    folder, result, report = loaded["unfused"]
    assert result.loaded, result.error
    assert report["layout"] == "unfused"  # the default conversion
    for layer, swa in LAYERS.items():
        expected, mixed = truth_and_mixed(src, layer, swa)
        got = result.weights[f"model.layers.{layer}.self_attn.qkv_proj"]
        assert got.shape == expected.shape
        assert torch.equal(got[~mixed], expected[~mixed])  # every block inside one source block: exact
        scale = result.weights[f"model.layers.{layer}.self_attn.qkv_proj::scale"].reshape(-1, expected.shape[1] // B1)
        per_element = scale.repeat_interleave(B0, 0)[: expected.shape[0]].repeat_interleave(B1, 1)
        exact = expected / per_element  # the code each value needs at its block's scale
        half_step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2**-6))) - 4)  # e4m3fn: 3 mantissa bits
        assert bool(((got / per_element - exact).abs() <= half_step + 1e-6)[mixed].all())
        module = next(m for m in report["modules"] if m["module"] == f"model.layers.{layer}.self_attn.qkv_proj")
        assert (module["blocks_requantized"] > 0) == bool(mixed.any())
        assert module["max_error_steps"] is None or module["max_error_steps"] <= 0.5
    for name in ("gate_up_proj", "down_proj"):  # the MLPs: byte moves, exact
        s = tensors(src)
        parts = ["gate_proj", "up_proj"] if name == "gate_up_proj" else ["down_proj"]
        expected = torch.cat(
            [
                s[f"model.layers.0.mlp.{p}.weight"].float()
                * s[f"model.layers.0.mlp.{p}.weight_scale_inv"]
                .float()
                .repeat_interleave(B0, 0)
                .repeat_interleave(B1, 1)
                for p in parts
            ]
        )
        assert torch.equal(result.weights[f"model.layers.0.mlp.{name}"], expected)


def test_vllm_requantizes_the_chunked_source_at_load(loaded: dict[str, tuple[Path, Loaded, dict]]) -> None:
    """What users without fp8fix get: vLLM 0.32 loads the pre-sharded source by requantizing every block
    at TP 1, so fewer weights keep their exact values than in fp8fix's split."""
    src, result, _ = loaded["source"]
    assert result.loaded, result.error
    _, unfused, _ = loaded["unfused"]
    expected, _ = truth_and_mixed(src, 0, False)
    from_source = result.weights["model.layers.0.self_attn.qkv_proj"]
    from_split = unfused.weights["model.layers.0.self_attn.qkv_proj"]
    exact_source = float((from_source == expected).float().mean())
    exact_split = float((from_split == expected).float().mean())
    print(f"exact values: {exact_split:.1%} through fp8fix's split, {exact_source:.1%} through vLLM's own regrouping")
    assert exact_split > exact_source
    assert torch.allclose(from_source, expected, rtol=2**-3, atol=float(expected.abs().max()) * 2**-7)


def test_fp8fix_verdicts_match_the_loaders(loaded: dict[str, tuple[Path, Loaded, dict]], tmp_path: Path) -> None:
    """vLLM loads both (values: the tests above); transformers 5.24 has no mimo_v2 model and refuses both."""
    interpreter("transformers")
    folders = [folder for folder, _, _ in loaded.values()]
    in_transformers = run_loader("transformers", folders, tmp_path / "transformers")
    for (name, (folder, result, _)), tf in zip(loaded.items(), in_transformers, strict=True):
        said = json.loads(run_cli("inspect", folder, "--json").output)["loaders"]
        assert result.loaded and said["vLLM >= 0.32"]["verdict"] == "loads", name
        assert not tf.loaded and "trust_remote_code" in tf.error and said["transformers"]["verdict"] == "fails"
