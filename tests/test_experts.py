"""Stacked MoE experts (Llama-4 / Qwen3-VL-MoE): `experts.gate_up_proj` [E, hidden, 2I], gate then up on
the LAST dimension, `experts.down_proj` [E, I, hidden]; scales named as transformers' FBGEMM experts name
them (`gate_up_proj_scale`). Built here from that documented layout with torch + safetensors, converted
with the CLI, checked by value and by `fp8fix verify` (conftest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.builders import FP8, FP8_MAX, quantize
from tests.conftest import load_tensors, run_cli, run_process

E, HIDDEN, INTER = 4, 32, 48
PREFIX = "language_model.model.layers.{i}.feed_forward.experts."
GATE_UP = PREFIX.format(i=0) + "gate_up_proj"


def build_llama4(root: Path, scale: str, layers: int = 2, arch: str = "Llama4ForConditionalGeneration") -> Path:
    """A Llama-4-shaped FP8 checkpoint. `scale`: tensor ([]), expert ([E]), shard ([E, 2]), channel ([E, 1, 2I])."""
    gen = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = PREFIX.format(i=i)
        gate = torch.randn(E, HIDDEN, INTER, generator=gen) * 0.02
        up = torch.randn(E, HIDDEN, INTER, generator=gen) * 0.5  # a different range, so shard scales differ
        w = torch.cat([gate, up], dim=2)
        if scale == "tensor":
            s = w.abs().max() / FP8_MAX
            tensors[p + "gate_up_proj"], tensors[p + "gate_up_proj_scale"] = quantize(w, s), s.reshape(())
        elif scale == "expert":
            s = w.abs().amax(dim=(1, 2)) / FP8_MAX
            tensors[p + "gate_up_proj"], tensors[p + "gate_up_proj_scale"] = quantize(w, s.reshape(E, 1, 1)), s
        elif scale == "shard":
            s = torch.stack([gate.abs().amax(dim=(1, 2)), up.abs().amax(dim=(1, 2))], dim=1) / FP8_MAX
            codes = torch.cat([quantize(gate, s[:, :1, None]), quantize(up, s[:, 1:, None])], dim=2)
            tensors[p + "gate_up_proj"], tensors[p + "gate_up_proj_scale"] = codes, s
        elif scale == "channel":
            s = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
            tensors[p + "gate_up_proj"], tensors[p + "gate_up_proj_scale"] = quantize(w, s), s
        down = torch.randn(E, INTER, HIDDEN, generator=gen) * 0.1
        down_scale = down.abs().amax(dim=1) / FP8_MAX  # FBGEMM: per output channel, [E, hidden, 1]
        tensors[p + "down_proj"] = quantize(down, down_scale.reshape(E, 1, HIDDEN))
        tensors[p + "down_proj_scale"] = down_scale.reshape(E, HIDDEN, 1)
        q = torch.randn(HIDDEN, HIDDEN, generator=gen)
        q_scale = q.abs().max() / FP8_MAX
        tensors[p.replace("feed_forward.experts.", "self_attn.q_proj.") + "weight"] = quantize(q, q_scale)
        tensors[p.replace("feed_forward.experts.", "self_attn.q_proj.") + "weight_scale"] = q_scale.reshape(())
    tensors["language_model.model.embed_tokens.weight"] = torch.randn(64, HIDDEN, generator=gen).bfloat16()
    text = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_local_experts": E, "num_hidden_layers": layers}
    config = {"architectures": [arch], "model_type": "llama4", "text_config": text}
    if arch == "Llama4ForCausalLM":
        config = {"architectures": [arch], "model_type": "llama4_text", **text}
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    root.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"), {"format": "pt"})
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def dequantized(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Values from the documented scale conventions, written independently of fp8fix."""
    w, s = t[name].float(), t[name + "_scale"].float()
    if s.numel() == 1:
        return w * s
    if s.shape == (E,):
        return w * s.reshape(E, 1, 1)
    if s.shape == (E, 2):  # gate columns at s[:, 0], up columns at s[:, 1]
        return w * s.repeat_interleave(w.shape[2] // 2, dim=1).reshape(E, 1, -1)
    if s.shape == (E, w.shape[2], 1):
        return w * s.reshape(E, 1, -1)
    return w * s  # [E, 1, out]


@pytest.mark.parametrize("scale", ["tensor", "expert"])
def test_per_shard_gives_each_expert_and_shard_its_scale(tmp_path: Path, scale: str) -> None:
    src = build_llama4(tmp_path / "src", scale)
    result = run_cli("convert", src, tmp_path / "out", "--layout", "per-shard")
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(tmp_path / "out")
    s = after[GATE_UP + "_scale"]
    assert s.shape == (E, 2) and s.dtype == torch.float32
    expected = before[GATE_UP + "_scale"].reshape(-1, 1).expand(E, 2) if scale == "expert" else None
    assert torch.equal(s, expected if expected is not None else before[GATE_UP + "_scale"].expand(E, 2))
    assert torch.equal(after[GATE_UP].view(torch.uint8), before[GATE_UP].view(torch.uint8))
    assert torch.equal(dequantized(after, GATE_UP), dequantized(before, GATE_UP))
    for name in before:  # everything else is untouched
        if not name.endswith("gate_up_proj_scale"):
            assert torch.equal(after[name].reshape(-1).view(torch.uint8), before[name].reshape(-1).view(torch.uint8))


def test_inspect_reports_single_scale_experts_and_the_fix_clears_it(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert")
    report = json.loads(run_cli("inspect", src, "--json").output)
    finding = next(f for f in report["findings"] if f["code"] == "fused-moe-experts")
    assert finding["fix"] == "--layout per-shard"
    assert finding["modules"] == [PREFIX.format(i=i) + "gate_up_proj" for i in range(2)]
    row = next(m for m in report["modules"] if m["module"] == GATE_UP)
    assert row["fused"] == "experts.gate_up_proj" and row["scale"] == "expert" and row["shards"] == 2
    assert run_cli("convert", src, tmp_path / "out").exit_code == 0  # the default layout is per-shard
    after = json.loads(run_cli("inspect", tmp_path / "out", "--json").output)
    assert not [f for f in after["findings"] if f["code"] == "fused-moe-experts"]


def test_fused_merges_equal_shard_scales_per_expert(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert")
    assert run_cli("convert", src, tmp_path / "split", "--layout", "per-shard").exit_code == 0
    result = run_cli("convert", tmp_path / "split", tmp_path / "back", "--layout", "fused")
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(tmp_path / "back")
    assert torch.equal(after[GATE_UP + "_scale"], before[GATE_UP + "_scale"])
    assert torch.equal(after[GATE_UP].view(torch.uint8), before[GATE_UP].view(torch.uint8))


def test_fused_refuses_unequal_shard_scales_and_unfused_is_refused(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "shard")
    result = run_cli("convert", src, tmp_path / "out", "--layout", "fused")
    assert result.exit_code == 3 and "strided columns" in result.output and "expert 0" in result.output
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused")
    assert result.exit_code == 3 and "experts.gate_up_proj" in result.output
    assert not (tmp_path / "out").exists()
    assert run_cli("convert", src, tmp_path / "out", "--layout", "per-shard").exit_code == 0  # already per-shard


@pytest.mark.parametrize("scale", ["channel", "shard", "expert"])
def test_e4m3fnuz_doubles_expert_scales_and_keeps_values(tmp_path: Path, scale: str) -> None:
    src = build_llama4(tmp_path / "src", scale)
    result = run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz")
    assert result.exit_code == 0, result.output
    before, after = load_tensors(src), load_tensors(tmp_path / "out")
    for name in (GATE_UP, PREFIX.format(i=1) + "down_proj"):
        assert after[name].dtype == torch.float8_e4m3fnuz
        old_scale = before[name + "_scale"]
        if name == GATE_UP and scale == "expert":  # default layout: per-shard, then doubled
            old_scale = old_scale.reshape(-1, 1).expand(E, 2)
        assert torch.equal(after[name + "_scale"], old_scale * 2), name
        value_after, value_before = dequantized(after, name), dequantized(before, name)
        assert torch.equal(value_after, value_before), name  # bit-exact in value (-0 reads as 0)
    back = tmp_path / "back"
    assert run_cli("convert", tmp_path / "out", back, "--to", "e4m3fn").exit_code == 0
    assert torch.equal(dequantized(load_tensors(back), GATE_UP), dequantized(before, GATE_UP))


def test_verify_catches_a_wrong_expert_scale_and_a_changed_code(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert", layers=1)
    out = tmp_path / "out"
    assert run_cli("convert", src, out).exit_code == 0
    tensors = load_tensors(out)
    good = {k: v.clone() for k, v in tensors.items()}
    tensors[GATE_UP + "_scale"][2, 1] *= 1.5
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "power of two" in result.output
    tensors = {k: v.clone() for k, v in good.items()}
    codes = tensors[GATE_UP].view(torch.uint8)
    codes[3, 5, INTER + 7] ^= 0x01  # one code of expert 3's up shard
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and "row 101 column 55" in result.output  # row = 3 * 32 + 5, column = 48 + 7


def test_config_must_match_the_stacked_experts(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert", arch="Llama4ForCausalLM")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = INTER + 8
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3 and "does not match the weights" in result.output and "56 + 56" in result.output


def test_experts_of_an_unknown_architecture_need_an_arch_file(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["MyMoeForCausalLM"]
    (src / "config.json").write_text(json.dumps(config))
    no_arch = tmp_path / "no-fused.json"
    no_arch.write_text(json.dumps({"architectures": ["MyMoeForCausalLM"], "fused_modules": []}))
    result = run_cli("convert", src, tmp_path / "out", "--arch-file", no_arch)
    assert result.exit_code == 3 and "stacked MoE experts" in result.output and "--arch-file" in result.output
    report = json.loads(run_cli("inspect", src, "--json", "--arch-file", no_arch).output)
    finding = next(f for f in report["findings"] if f["code"] == "fused-moe-experts")
    assert GATE_UP in finding["modules"] and finding["fix"] is None and "--arch-file" in finding["reason"]
    entry = {
        "architectures": ["MyMoeForCausalLM"],
        "fused_modules": [],
        "experts": {
            "module": "feed_forward.experts",
            "count": "text_config.num_local_experts",
            "fused": {
                "gate_up_proj": [
                    {"shard": "gate", "columns": "text_config.intermediate_size"},
                    {"shard": "up", "columns": "text_config.intermediate_size"},
                ]
            },
        },
    }
    arch = tmp_path / "my-moe.json"
    arch.write_text(json.dumps(entry))
    result = run_cli("convert", src, tmp_path / "out", "--arch-file", arch)
    assert result.exit_code == 0, result.output
    assert load_tensors(tmp_path / "out")[GATE_UP + "_scale"].shape == (E, 2)


def test_block_scales_on_experts_are_refused(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert", layers=1)
    tensors = load_tensors(src)
    tensors[GATE_UP + "_scale_inv"] = torch.ones(E, 1, 1, 1)
    del tensors[GATE_UP + "_scale"]
    tensors[PREFIX.format(i=0) + "down_proj_scale_inv"] = tensors.pop(PREFIX.format(i=0) + "down_proj_scale")
    q = "language_model.model.layers.0.self_attn.q_proj."
    tensors[q + "weight_scale_inv"] = torch.ones(1, 1)
    del tensors[q + "weight_scale"]
    save_file(tensors, str(src / "model.safetensors"), {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (src / "config.json").write_text(json.dumps(config))
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 3 and "block scales" in result.output and "stacked experts" in result.output
    assert FP8 == torch.float8_e4m3fn  # the fixture's encoding, for the reader


def test_inspect_flags_a_zero_expert_scale(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "expert", layers=1)
    tensors = load_tensors(src)
    tensors[GATE_UP + "_scale"][1] = 0.0
    save_file(tensors, str(src / "model.safetensors"), {"format": "pt"})
    report = json.loads(run_cli("inspect", src, "--json").output)
    finding = next(f for f in report["findings"] if f["code"] == "bad-scale-value")
    assert finding["modules"] == [GATE_UP]
    result = run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz")
    assert result.exit_code == 3 and f"'{GATE_UP}_scale' holds 0.0" in result.output
    assert not (tmp_path / "out").exists()


def test_verify_jobs_check_experts_in_forked_processes(tmp_path: Path) -> None:
    """Stacked experts are checked with torch; in forked workers of a CLI process (which has not loaded
    torch) that works, and the report is the one-process report."""
    src = build_llama4(tmp_path / "src", "expert")
    assert run_cli("convert", src, tmp_path / "out", "--to", "e4m3fnuz").exit_code == 0
    one, two = (run_process("verify", src, tmp_path / "out", "--json", "--jobs", n) for n in ("1", "2"))
    assert one.returncode == two.returncode == 0, two.stderr
    assert json.loads(one.stdout) == json.loads(two.stdout)
    assert any(w["tensor"] == GATE_UP for w in json.loads(two.stdout)["weights"])


def test_verify_names_stacked_experts_of_the_wrong_dtype(tmp_path: Path) -> None:
    """Stacked experts OUTPUT holds in F32 (not a dtype a weight is written unquantized in: BF16 ones are checked
    by value, tests/test_unquantized.py): the problem names the tensor, both dtypes and shapes (a mutant of
    verify raised it without a message)."""
    src = build_llama4(tmp_path / "src", "expert", layers=1)
    out = tmp_path / "out"
    assert run_cli("convert", src, out).exit_code == 0
    tensors = load_tensors(out)
    tensors[GATE_UP] = tensors[GATE_UP].to(torch.float32)
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    result = run_cli("verify", src, out)
    shape = list(tensors[GATE_UP].shape)
    assert result.exit_code == 1 and f"'{GATE_UP}' is F32 {shape}, expected FP8 {shape}" in result.output


@pytest.mark.parametrize("key", ["ignored_layers", "modules_to_not_convert"])
@pytest.mark.parametrize(
    "entry",
    [
        "language_model.model.layers.0.feed_forward.experts.0.down_proj",  # one expert of the stack: FP8 codes
        "language_model.model.layers.0.feed_forward.experts",  # the whole stack
        "model.layers.0.mlp.experts.0.down_proj",  # no module of this model: not SOURCE's, no rule writes it
    ],
)
def test_an_ignore_list_entry_naming_fp8_experts_or_nothing_fails_verify(tmp_path: Path, key: str, entry: str) -> None:
    """Issue 48: an ignore-list entry added to an output with stacked FP8 experts passed verify (the name lists
    knew only `.weight` modules): a loader that honours it reads that expert's FP8 codes as BF16."""
    src = build_llama4(tmp_path / "src", "tensor")
    out = tmp_path / "out"
    assert run_cli("convert", src, out, "--format", "keep", "-q").exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"][key] = [entry]
    (out / "config.json").write_text(json.dumps(config))
    result = run_cli("verify", src, out)
    assert result.exit_code == 1 and f"quantization_config.{key}" in result.output and entry in result.output
