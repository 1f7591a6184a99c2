"""`convert --tp N` through the real vLLM 0.32 loader (issue 17): the padded checkpoint is loaded as every
rank of TP N (tests/loaders/vllm_tp_load.py: one model per rank, the TP group's size and rank set), with
vLLM's own weight loaders and block-shape validation; the ranks' MLP slices put back together must be
the padded weights exactly (no refined MoE blocks), and the MLPs must compute the source's outputs.
The source, loaded as rank 0, shows what the padding avoids: a refused down_proj, refined MoE blocks.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import load_tensors, run_cli
from tests.loaders.conftest import HERE, interpreter
from tests.test_parallel import deepseek_dense, qwen3_moe, shared_expert

pytestmark = pytest.mark.loaders
B = 128


def dequant(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """float32 weights as vLLM multiplies with them: code x block scale, one rounding."""
    codes, grid = t[f"{module}.weight"], t[f"{module}.weight_scale_inv"]
    rows, cols = codes.shape
    per_element = grid.double().repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]
    return (codes.double() * per_element).float()


def load_ranks(folder: Path, tp: int, out: Path) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    code = (
        "import sys; from pathlib import Path; import vllm_tp_load as v; "
        f"[v.load_rank(Path({str(folder)!r}), {tp}, r, Path({str(out)!r}) / str(r)) for r in {list(range(tp))!r}]"
    )
    proc = subprocess.run([interpreter("vllm"), "-c", code], cwd=HERE, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = []
    for r in range(tp):
        result = json.loads((out / str(r) / "result.json").read_text())
        weights = load_file(out / str(r) / "weights.safetensors") if result["loaded"] else {}
        ranks.append((result, weights))
    return ranks


def source_rank0(src: Path, tp: int, out: Path) -> dict:
    """What vLLM does with the unpadded source as rank 0 of `tp` (its result.json)."""
    code = "from pathlib import Path; import vllm_tp_load as v; " + (
        f"v.load_rank(Path({str(src)!r}), {tp}, 0, Path({str(out)!r}))"
    )
    subprocess.run([interpreter("vllm"), "-c", code], cwd=HERE, capture_output=True, timeout=600)
    return json.loads((out / "result.json").read_text())


def merged_mlp(
    ranks: list[tuple[dict, dict[str, torch.Tensor]]], prefix: str
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense MLP put back together from the ranks' slices: (share per rank, gate, up, down). Each rank
    holds [its gate rows; its up rows] in gate_up_proj and its columns of down_proj."""
    gate_up = [w[f"{prefix}.gate_up_proj"] for _, w in ranks]
    share = gate_up[0].shape[0] // 2
    gate, up = torch.cat([w[:share] for w in gate_up]), torch.cat([w[share:] for w in gate_up])
    return share, gate, up, torch.cat([w[f"{prefix}.down_proj"] for _, w in ranks], dim=1)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.nn.functional.silu(x @ gate.double().T) * (x @ up.double().T)
    return h, h @ down.double().T


def same_mlp(
    src: dict[str, torch.Tensor], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, prefix: str
) -> None:
    """The padded MLP computes the source's: the same activations, zeros in the padding, the same output."""
    x = torch.randn(16, gate.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h_src, y_src = swiglu(*(dequant(src, f"{prefix}.{p}") for p in ("gate_proj", "up_proj", "down_proj")), x)
    h, y = swiglu(gate, up, down, x)
    width = h_src.shape[1]
    # the padded activations are exactly 0; the rest and the output equal up to the summation order of
    # float64 matrix products of other widths (BLAS picks its kernels by shape)
    assert not h[:, width:].any() and torch.allclose(h[:, :width], h_src, rtol=1e-12, atol=0)
    assert torch.allclose(y, y_src, rtol=1e-12, atol=0)


def test_qwen3_moe_padded_for_tp_4_loads_as_every_rank(tmp_path: Path) -> None:
    src = qwen3_moe(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "out", "--tp", "4", "-q").exit_code == 0
    ranks = load_ranks(tmp_path / "out", 4, tmp_path / "vllm")
    layer = "model.layers.0.mlp.experts.routed_experts"
    assert all(r["loaded"] and r["moe_refined"] == {layer: None} for r, _ in ranks), [r for r, _ in ranks]
    out, s = load_tensors(tmp_path / "out"), load_tensors(src)
    w13 = [w[f"{layer}.w13"] for _, w in ranks]  # each [E, gate share; up share, hidden]
    share = w13[0].shape[1] // 2
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        gate = torch.cat([w[e, :share] for w in w13])
        up = torch.cat([w[e, share:] for w in w13])
        down = torch.cat([w[f"{layer}.w2"][e] for _, w in ranks], dim=1)
        assert torch.equal(gate, dequant(out, f"{p}.gate_proj")) and torch.equal(up, dequant(out, f"{p}.up_proj"))
        assert torch.equal(down, dequant(out, f"{p}.down_proj"))
        same_mlp(s, gate, up, down, p)
    (at_tp1, _), *_ = load_ranks(src, 1, tmp_path / "src-tp1")  # the source loads at TP 1 ...
    assert at_tp1["loaded"]
    refined = source_rank0(src, 4, tmp_path / "src-tp4")["moe_refined"]
    assert refined == {layer: [4, 4]}  # ... and at TP 4 only with its blocks refined to 32x32 (Triton only)


def test_deepseek_dense_padded_for_tp_32_loads_as_every_rank(tmp_path: Path) -> None:
    src = deepseek_dense(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "out", "--tp", "32", "-q").exit_code == 0
    ranks = load_ranks(tmp_path / "out", 32, tmp_path / "vllm")
    assert all(r["loaded"] for r, _ in ranks), [r for r, _ in ranks if not r["loaded"]][:1]
    p = "model.layers.0.mlp"
    out, s = load_tensors(tmp_path / "out"), load_tensors(src)
    share, gate, up, down = merged_mlp(ranks, p)
    assert share == 8192 // 32 and down.shape == (256, 8192)
    assert torch.equal(gate, dequant(out, f"{p}.gate_proj")) and torch.equal(down, dequant(out, f"{p}.down_proj"))
    same_mlp(s, gate, up, down, p)
    refused = source_rank0(src, 32, tmp_path / "src-tp32")
    assert not refused["loaded"]
    assert (
        "Weight input_size_per_partition = 144 is not divisible by weight quantization block_k = 128."
        in refused["error"]
    )


def test_shared_expert_padded_for_tp_8_loads_as_every_rank(tmp_path: Path) -> None:
    src = shared_expert(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "out", "--tp", "8", "-q").exit_code == 0
    ranks = load_ranks(tmp_path / "out", 8, tmp_path / "vllm")
    layer = "model.layers.0.mlp.experts.routed_experts"
    assert all(r["loaded"] and r["moe_refined"] == {layer: None} for r, _ in ranks), [r for r, _ in ranks]
    p = "model.layers.0.mlp.shared_expert"
    out, s = load_tensors(tmp_path / "out"), load_tensors(src)
    share, gate, up, down = merged_mlp(ranks, p)
    assert share == 1024 // 8 and torch.equal(down, dequant(out, f"{p}.down_proj"))
    same_mlp(s, gate, up, down, p)
    refused = source_rank0(src, 8, tmp_path / "src-tp8")
    assert not refused["loaded"]
    assert (
        "Weight input_size_per_partition = 64 is not divisible by weight quantization block_k = 128."
        in refused["error"]
    )
