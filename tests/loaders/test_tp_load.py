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
from safetensors.torch import load_file, save_file

from tests.conftest import load_tensors, run_cli
from tests.loaders.conftest import HERE, interpreter, run_loader
from tests.test_parallel import deepseek_dense, groups, narrow_heads, partial_q, qwen3_moe, shared_expert

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
    # float64 matrix products of other widths (BLAS picks its kernels by shape and CPU): within the
    # summation's error bound, n x eps x the sum of the terms' magnitudes, not relative to a result that
    # cancels to near 0
    assert not h[:, width:].any() and torch.allclose(h[:, :width], h_src, rtol=1e-12, atol=0)
    terms = h_src.abs() @ dequant(src, f"{prefix}.down_proj").double().abs().T
    assert ((y - y_src).abs() <= terms * width * torch.finfo(torch.float64).eps).all()


def same_experts(ranks: list[tuple[dict, dict[str, torch.Tensor]]], out: Path, src: Path, experts: int) -> None:
    """Every routed expert put back together from the ranks' w13 / w2 slices is OUTPUT's padded expert
    exactly, and computes the source expert's outputs; no rank refined its MoE blocks."""
    layer = "model.layers.0.mlp.experts.routed_experts"
    assert all(r["loaded"] and r["moe_refined"] == {layer: None} for r, _ in ranks), [r for r, _ in ranks]
    o, s = load_tensors(out), load_tensors(src)
    w13 = [w[f"{layer}.w13"] for _, w in ranks]  # each [E, gate share; up share, hidden]
    share = w13[0].shape[1] // 2
    for e in range(experts):
        p = f"model.layers.0.mlp.experts.{e}"
        gate = torch.cat([w[e, :share] for w in w13])
        up = torch.cat([w[e, share:] for w in w13])
        down = torch.cat([w[f"{layer}.w2"][e] for _, w in ranks], dim=1)
        assert torch.equal(gate, dequant(o, f"{p}.gate_proj")) and torch.equal(up, dequant(o, f"{p}.up_proj"))
        assert torch.equal(down, dequant(o, f"{p}.down_proj"))
        same_mlp(s, gate, up, down, p)


def test_qwen3_moe_padded_for_tp_4_loads_as_every_rank(tmp_path: Path) -> None:
    src = qwen3_moe(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "out", "--tp", "4", "-q").exit_code == 0
    ranks = load_ranks(tmp_path / "out", 4, tmp_path / "vllm")
    layer = "model.layers.0.mlp.experts.routed_experts"
    same_experts(ranks, tmp_path / "out", src, 4)
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


ATTENTION = "model.layers.0.self_attn"
QKV = ("q_proj", "k_proj", "v_proj")


def head_rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of narrow_heads' q, k or v at TP 8: one head of 64 rows (k and v: one of the 2 kv
    heads, each held by 4 ranks)."""
    head = rank if t.shape[0] == 8 * 64 else rank // 4
    return t[64 * head : 64 * (head + 1)]


def test_attention_in_bf16_loads_as_every_rank_of_tp_8(tmp_path: Path) -> None:
    """At TP 8 narrow_heads' 8 heads of 64 give each rank 64 rows of q, k and v and 64 columns of o_proj:
    `--tp 8 --tp-bf16` pads the experts and writes q, k, v and o in BF16. Every rank loads, holds its
    head's rows of q, k, v and its columns of o_proj exactly as OUTPUT has them (within half a BF16
    step of SOURCE's values); the experts are whole blocks per rank and compute the source's outputs.
    transformers loads the same output with those layers as plain BF16 ones."""
    src = narrow_heads(tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "out", "--tp", "8", "--tp-bf16", "--json")
    assert result.exit_code == 0, result.output
    said = json.loads(result.stdout)["tensor_parallel"]
    assert sorted(m["module"] for m in said["bf16"]) == [f"{ATTENTION}.{m}" for m in ("k_proj", "o_proj", *QKV[::2])]
    assert all(0 < m["max_error_steps"] <= 0.5 for m in said["bf16"])
    ranks = load_ranks(tmp_path / "out", 8, tmp_path / "vllm")
    same_experts(ranks, tmp_path / "out", src, 8)
    out, s = load_tensors(tmp_path / "out"), load_tensors(src)
    q, k, v, o = (out[f"{ATTENTION}.{m}.weight"] for m in (*QKV, "o_proj"))
    assert {t.dtype for t in (q, k, v, o)} == {torch.bfloat16}
    for rank, (_, w) in enumerate(ranks):
        expected = torch.cat([head_rows(t, rank) for t in (q, k, v)]).float()
        assert torch.equal(w[f"{ATTENTION}.qkv_proj"], expected)
        assert torch.equal(w[f"{ATTENTION}.o_proj"], o[:, 64 * rank : 64 * (rank + 1)].float())
    for m, got in zip((*QKV, "o_proj"), (q, k, v, o), strict=True):
        true = dequant(s, f"{ATTENTION}.{m}").double()
        assert ((got.double() - true).abs() <= true.abs() * 2**-8).all()  # one rounding to BF16
    # transformers (no tensor parallelism here) reads modules_to_not_convert: plain BF16 layers, every key used
    (tf,) = run_loader("transformers", [tmp_path / "out"], tmp_path / "transformers")
    assert tf.loaded and not tf.missing and not tf.unexpected, tf.error
    for m, got in zip((*QKV, "o_proj"), (q, k, v, o), strict=True):
        assert torch.equal(tf.weights[f"{ATTENTION}.{m}"], got.float())


def test_qkv_shares_of_partial_blocks_fail_or_load_other_blocks_scales(tmp_path: Path) -> None:
    """Why `--tp-bf16` takes q, k and v along, and what `inspect --tp` says of them: the same conversion
    with q, k, v put back as SOURCE's FP8 (only o_proj in BF16), as every rank of TP 8. vLLM rounds each
    shard's scale offset up to whole blocks: ranks 4-7 (the second kv head) fail with a message inspect
    gives (so the group refuses), and ranks 0-3 load SOURCE's codes with scales that do not line up."""
    src = narrow_heads(tmp_path / "src")
    assert run_cli("convert", src, tmp_path / "bf16", "--tp", "8", "--tp-bf16", "-q").exit_code == 0
    out, s = load_tensors(tmp_path / "bf16"), load_tensors(src)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for m in QKV:
        for param in ("weight", "weight_scale_inv"):
            out[f"{ATTENTION}.{m}.{param}"] = s[f"{ATTENTION}.{m}.{param}"]
    save_file(out, str(mixed / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = [f"{ATTENTION}.o_proj"]
    (mixed / "config.json").write_text(json.dumps(config))
    report = json.loads(run_cli("inspect", mixed, "--tp", "8", "--json").output)["tensor_parallel"]
    kv = groups(report, 8)["model.layers.0.self_attn.{k_proj,v_proj}"]
    assert kv["behaviour"] == "refuses" and not kv["loads"]
    ranks = load_ranks(mixed, 8, tmp_path / "vllm")
    assert [r["loaded"] for r, _ in ranks] == [True] * 4 + [False] * 4
    for r, _ in ranks[4:]:
        assert r["error"].removeprefix("RuntimeError: ") in kv["message"]  # "start (1) + length (1) exceeds ..."
    true = {m: dequant(s, f"{ATTENTION}.{m}") for m in QKV}
    for rank, (_, w) in enumerate(ranks[:4]):
        codes, grid = w[f"{ATTENTION}.qkv_proj::codes"], w[f"{ATTENTION}.qkv_proj::scale"]
        rows, cols = codes.shape
        scales = grid.repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]  # the kernels' 128-row grid
        source_codes = torch.cat([head_rows(s[f"{ATTENTION}.{m}.weight"].float(), rank) for m in QKV])
        assert torch.equal(codes, source_codes)  # the codes are SOURCE's ...
        expected = torch.cat([head_rows(true[m], rank) for m in QKV])
        assert not torch.equal(codes * scales, expected)  # ... their scales are not


def test_heads_that_do_not_split_are_refused_whatever_the_dtype(tmp_path: Path) -> None:
    """4 heads at TP 8: vLLM's attention asserts before any block is looked at; inspect says so, and
    `--tp-bf16` refuses (BF16 would not split them either) instead of writing a checkpoint that cannot load."""
    src = qwen3_moe(tmp_path / "src", experts=8)
    refused = source_rank0(src, 8, tmp_path / "src-tp8")
    assert not refused["loaded"] and refused["error"].startswith("AssertionError")
    assert "models/qwen3_moe.py:" in refused["where"]  # the attention class, before any linear layer
    report = json.loads(run_cli("inspect", src, "--tp", "8", "--json").output)["tensor_parallel"]
    attention = [g for g in report["sizes"]["8"]["modules"] if "self_attn" in g["modules"]]
    assert attention and all("num_attention_heads = 4 does not split 8 ways" in g["message"] for g in attention)
    result = run_cli("convert", src, tmp_path / "out", "--tp", "8", "--tp-bf16")
    assert result.exit_code == 3 and "no dtype splits them" in result.output
    assert not (tmp_path / "out").exists()


def shifted_rows(codes: torch.Tensor, grid: torch.Tensor, expected: torch.Tensor) -> list[int]:
    """Rows of a packed layer whose codes x the scales vLLM loaded (its kernels' 128-row grid) are not
    `expected`."""
    rows, cols = codes.shape
    scales = grid.repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]
    return (codes * scales != expected).any(dim=1).nonzero().flatten().tolist()


def test_shards_not_whole_blocks_shift_the_next_ones_scales_at_tp_1(tmp_path: Path) -> None:
    """vLLM >= 0.20's verdicts on a packed layer whose shard before the last is not whole blocks, and the
    fixes. At TP 1, q of 192 rows (1.5 blocks) and k of 64 leave every row of k and v scaled by other
    blocks' scales, the codes right (loads-wrong); `--tp 1 --tp-bf16` loads q / k / v exactly. A dense
    gate of 4672 rows (36.5 blocks) makes up's scale range run out (fails, with the message inspect
    gives); `--tp 1` pads it to 4736 and gate / up load exactly."""
    src, dense = partial_q(tmp_path / "src"), deepseek_dense(tmp_path / "dense", intermediate=4608 + 64)
    assert run_cli("convert", src, tmp_path / "bf16", "--tp", "1", "--tp-bf16", "-q").exit_code == 0
    assert run_cli("convert", dense, tmp_path / "padded", "--tp", "1", "-q").exit_code == 0
    (_, w), (_, w_bf16), (r_dense, _), (_, w_padded) = (
        load_ranks(folder, 1, tmp_path / f"vllm-{folder.name}")[0]
        for folder in (src, tmp_path / "bf16", dense, tmp_path / "padded")
    )
    said = json.loads(run_cli("inspect", src, "--json").output)["loaders"]["vLLM >= 0.32"]["verdict"]
    assert said == "loads-wrong"
    s, o = load_tensors(src), load_tensors(tmp_path / "bf16")
    true = torch.cat([dequant(s, f"{ATTENTION}.{m}") for m in QKV])
    shifted = shifted_rows(w[f"{ATTENTION}.qkv_proj::codes"], w[f"{ATTENTION}.qkv_proj::scale"], true)
    assert shifted == list(range(192, 320))  # k and v, all of them
    assert torch.equal(
        w[f"{ATTENTION}.qkv_proj::codes"], torch.cat([s[f"{ATTENTION}.{m}.weight"].float() for m in QKV])
    )
    assert torch.equal(w_bf16[f"{ATTENTION}.qkv_proj"], torch.cat([o[f"{ATTENTION}.{m}.weight"] for m in QKV]).float())
    mlp = "model.layers.0.mlp"
    report = json.loads(run_cli("inspect", dense, "--tp", "1", "--json").output)
    assert report["loaders"]["vLLM >= 0.32"]["verdict"] == "fails"
    (gate,) = report["tensor_parallel"]["sizes"]["1"]["modules"]
    assert not r_dense["loaded"] and r_dense["error"].removeprefix("RuntimeError: ") in gate["message"]
    padded = load_tensors(tmp_path / "padded")
    expected = torch.cat([dequant(padded, f"{mlp}.gate_proj"), dequant(padded, f"{mlp}.up_proj")])
    assert torch.equal(w_padded[f"{mlp}.gate_up_proj"], expected)
