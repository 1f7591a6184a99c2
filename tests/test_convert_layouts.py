"""convert on real tiny Phi-3 checkpoints: every layout and format, checked by value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import FP8, FP8_MAX, build, phi3
from tests.conftest import dequant, folder_digest, load_tensors, raw, run_cli, shard_files

UNFUSED = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
}
FORMATS = ["fp8", "compressed-tensors"]


def fused_modules(layers: int = 2):
    model = phi3(layers=layers)
    for layer in range(layers):
        for f in model.fused:
            yield f"model.layers.{layer}.{f.suffix}", f


def shard_scale(scale: torch.Tensor, i: int, start: int, rows: int) -> torch.Tensor:
    """The source scale that multiplies shard i's rows, as the test reads the documented conventions."""
    if scale.numel() == 1:
        return scale
    if scale.dim() == 1 and scale.shape[0] <= 3:  # per-shard vector
        return scale[i]
    return scale[start : start + rows]  # per-channel [out, 1]


def assert_untouched(src: dict, out: dict, skip: set[str]) -> None:
    for name, t in src.items():
        if name in skip:
            continue
        assert name in out, f"{name} dropped"
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert raw(out[name]) == raw(t), f"{name} changed"


def assert_index_consistent(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = load_tensors(folder)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", ["tensor", "shard", "channel"])
def test_unfused_splits_rows_and_scales_exactly(tmp_path: Path, fmt: str, scale: str) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale=scale, bias=True)
    before = folder_digest(src)
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q")
    assert result.exit_code == 0, result.output
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    touched: set[str] = set()
    per_tensor_shape = () if fmt == "fp8" else (1,)
    for module, f in fused_modules():
        params = ["weight", "weight_scale", "input_scale", "bias"]
        touched |= {f"{module}.{p}" for p in params}
        for p in params:
            assert f"{module}.{p}" not in o
        start = 0
        for i, (suffix, rows) in enumerate(zip(UNFUSED[f.suffix], f.rows, strict=True)):
            new = module.replace(f.suffix, suffix)
            src_rows = s[f"{module}.weight"][start : start + rows]
            src_scale = shard_scale(s[f"{module}.weight_scale"], i, start, rows)
            out_w, out_s = o[f"{new}.weight"], o[f"{new}.weight_scale"]
            assert out_w.dtype == FP8 and out_w.shape == (rows, f.in_features)
            assert raw(out_w) == raw(src_rows)
            assert out_s.dtype == s[f"{module}.weight_scale"].dtype
            expected_shape = (rows, 1) if scale == "channel" else per_tensor_shape
            assert tuple(out_s.shape) == expected_shape
            assert raw(dequant(out_w, out_s)) == raw(dequant(src_rows, src_scale)), f"{new}: values differ"
            src_input = shard_scale(s[f"{module}.input_scale"], i, start, rows)
            assert o[f"{new}.input_scale"].shape == per_tensor_shape
            assert raw(o[f"{new}.input_scale"]) == raw(src_input)
            assert raw(o[f"{new}.bias"]) == raw(s[f"{module}.bias"][start : start + rows])
            start += rows
    assert_untouched(s, o, touched)
    assert_index_consistent(tmp_path / "out")
    assert folder_digest(src) == before, "SOURCE was modified"


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_shard_writes_scale_vectors(tmp_path: Path, fmt: str) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale="tensor")
    result = run_cli("convert", src, tmp_path / "out", "--layout", "per-shard", "-q")
    assert result.exit_code == 0, result.output
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    touched = set()
    for module, f in fused_modules():
        n = len(f.rows)
        for p in ("weight_scale", "input_scale"):
            touched.add(f"{module}.{p}")
            vec = o[f"{module}.{p}"]
            assert vec.shape == (n,) and vec.dtype == s[f"{module}.{p}"].dtype
            assert all(raw(vec[i]) == raw(s[f"{module}.{p}"].reshape(())) for i in range(n))
        w = o[f"{module}.weight"]
        start = 0
        for i, rows in enumerate(f.rows):
            expected = dequant(s[f"{module}.weight"][start : start + rows], s[f"{module}.weight_scale"])
            assert raw(w[start : start + rows].float() * vec_at(o, module, i)) == raw(expected)
            start += rows
    assert_untouched(s, o, touched)
    assert_index_consistent(tmp_path / "out")


def vec_at(o: dict, module: str, i: int) -> torch.Tensor:
    return o[f"{module}.weight_scale"][i].float()


def test_per_shard_keeps_channel_scales(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors", scale="channel", static_input=False)
    assert run_cli("convert", src, tmp_path / "out", "--layout", "per-shard", "-q").exit_code == 0
    assert_untouched(load_tensors(src), load_tensors(tmp_path / "out"), set())


def test_fused_from_single_scale_changes_nothing(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), scale="tensor")
    assert run_cli("convert", src, tmp_path / "out", "--layout", "fused", "-q").exit_code == 0
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    assert set(s) == set(o)
    assert_untouched(s, o, set())


def reference_requantize(codes: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The issue's formula, written independently: float32 dequantize, divide, clamp +-448, round to nearest even."""
    return ((codes.float() * scale.float()) / target.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_requantizes_shards_to_the_largest_scale(tmp_path: Path, fmt: str) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt, scale="shard")
    result = run_cli("convert", src, tmp_path / "out", "--layout", "fused", "--json", "-q")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    s, o = load_tensors(src), load_tensors(tmp_path / "out")
    per_tensor_shape = () if fmt == "fp8" else (1,)
    for module, f in fused_modules():
        scales = s[f"{module}.weight_scale"]
        top = scales.float().max()
        out_scale = o[f"{module}.weight_scale"]
        assert tuple(out_scale.shape) == per_tensor_shape and out_scale.dtype == scales.dtype
        assert out_scale.float().item() == top.item()
        assert o[f"{module}.input_scale"].float().item() == s[f"{module}.input_scale"].float().max().item()
        start, worst = 0, 0.0
        for i, rows in enumerate(f.rows):
            src_rows = s[f"{module}.weight"][start : start + rows]
            got = o[f"{module}.weight"][start : start + rows]
            assert raw(got) == raw(reference_requantize(src_rows, scales[i], top))
            err = (got.float() * top - src_rows.float() * scales[i].float()).abs()
            # half an fp8 step at the max scale: step of the value's binade, 2^-9 at the bottom
            exact = src_rows.float() * scales[i].float() / top
            step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2.0**-6))) - 3)
            assert bool((err <= 0.5 * step * top * (1 + 1e-6)).all())
            worst = max(worst, float(err.max()))
            start += rows
        entry = next(m for m in report["modules"] if m["module"] == module)
        assert entry["action"] == "requantize"
        assert entry["max_error"] == pytest.approx(worst, rel=1e-6)
        assert 0 < entry["max_error_steps"] <= 0.5


def test_fused_with_equal_shard_scales_changes_no_weight_byte(tmp_path: Path, rewrite_header) -> None:
    src = build(tmp_path / "src", phi3(layers=1), scale="shard", files=1)
    tensors = load_tensors(src)
    # make every entry of each scale vector equal, by editing the bytes of the real file
    from safetensors.torch import save_file

    for name, t in tensors.items():
        if name.endswith("weight_scale") and t.dim() == 1 and t.shape[0] <= 3:
            tensors[name] = torch.full_like(t, float(t.max()))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli("convert", src, tmp_path / "out", "--layout", "fused", "--json", "-q")
    assert result.exit_code == 0, result.output
    o = load_tensors(tmp_path / "out")
    for module, _ in fused_modules(layers=1):
        assert raw(o[f"{module}.weight"]) == raw(tensors[f"{module}.weight"])
        assert o[f"{module}.weight_scale"].shape == ()
    actions = {m["action"] for m in json.loads(result.stdout)["modules"]}
    assert actions == {"merge-equal-scales"}


def test_unfused_renames_fused_modules_in_ignore_lists(tmp_path: Path) -> None:
    ignored = "model.layers.1.self_attn.qkv_proj"
    src = build(
        tmp_path / "src", phi3(), fmt="compressed-tensors", ignore=["lm_head", ignored, "re:.*layers\\.1\\..*qkv"]
    )
    result = run_cli("convert", src, tmp_path / "out", "--layout", "unfused", "-q")
    assert result.exit_code == 0, result.output
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    shards = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert after["quantization_config"]["ignore"] == ["lm_head", *shards, "re:.*layers\\.1\\..*qkv"]
    del before["quantization_config"]["ignore"], after["quantization_config"]["ignore"]
    assert before == after
    o, s = load_tensors(tmp_path / "out"), load_tensors(src)
    # the ignored (BF16) fused module is unfused too, by rows
    assert o[shards[1] + ".weight"].dtype == torch.bfloat16
    assert raw(o[shards[1] + ".weight"]) == raw(s[ignored + ".weight"][64:96])


def test_output_is_a_complete_repo_and_deterministic(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3())
    (src / "README.md").write_text("---\nlicense: mit\n---\n# Tiny Phi-3 FP8\nOriginal card text.\n")
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("kept")
    assert run_cli("convert", src, tmp_path / "a", "--format", "keep", "-q").exit_code == 0
    assert run_cli("convert", src, tmp_path / "b", "--format", "keep", "-q").exit_code == 0
    assert folder_digest(tmp_path / "a") == folder_digest(tmp_path / "b")
    out = tmp_path / "a"
    for name in ("generation_config.json", "tokenizer_config.json", "sub/notes.txt"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    card = (out / "README.md").read_text()
    assert "license: mit" in card and "- fp8fix" in card and "Original card text." in card
    assert "fp8fix convert --layout unfused" in card
    for file in set(shard_files(out).values()):
        from safetensors import safe_open

        with safe_open(out / file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert sorted(set(shard_files(out).values())) == sorted(set(shard_files(src).values()))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folder left behind"


def test_single_file_checkpoint_without_index(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), files=1)
    assert run_cli("convert", src, tmp_path / "out", "--format", "keep", "-q").exit_code == 0
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert "model.layers.0.self_attn.q_proj.weight" in load_tensors(tmp_path / "out")


def test_unfused_moves_nan_codes_as_they_are(tmp_path: Path) -> None:
    """Splitting moves bytes and never recomputes them: a NaN stays the NaN it was (inspect --scan-data finds it);
    only conversions that recompute codes (requantize, --to) refuse NaN codes."""
    from tests.conftest import patch_bytes

    src = build(tmp_path / "src", phi3())
    patch_bytes(src, "model.layers.0.self_attn.qkv_proj.weight", {1: 0x7F})
    assert run_cli("convert", src, tmp_path / "out", "--format", "keep", "-q").exit_code == 0
    q = load_tensors(tmp_path / "out")["model.layers.0.self_attn.q_proj.weight"]
    assert raw(q)[1] == 0x7F


def test_card_metadata_is_what_the_hub_reads(tmp_path: Path) -> None:
    """OUTPUT's front matter is SOURCE's metadata as huggingface_hub normalizes it, plus fp8fix's tags,
    read back by huggingface_hub's own ModelCard; rendered as `CardData.to_yaml` renders it."""
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import ModelCardData

    from fp8fix.report.model_card import metadata_yaml

    src = build(tmp_path / "src", phi3())
    front = (
        "---\nlicense: apache-2.0\nlanguage: [en, ja]\ntags: [phi3, chat]\nwidget:\n- text: こんにちは\n"
        "model-index:\n- name: tiny\n  results:\n  - task: {type: text-generation}\n"
        "    dataset: {name: wiki, type: wikitext}\n    metrics: [{type: perplexity, value: 9.5}]\n---\nText.\n"
    )
    (src / "README.md").write_text(front, encoding="utf-8")
    assert run_cli("convert", src, tmp_path / "out", "-q", "--to", "e4m3fnuz").exit_code == 0
    written = ModelCard.load(tmp_path / "out" / "README.md").data.to_dict()
    expected = ModelCard.load(src / "README.md").data.to_dict()
    expected["tags"] = ["phi3", "chat", "fp8", "fp8fix", "e4m3fnuz", "rocm"]
    assert written == expected
    assert written["widget"] == [{"text": "こんにちは"}] and written["model-index"][0]["name"] == "tiny"
    data = ModelCardData(license="mit", tags=["ü", "b"], base_model="org/x", zeta=1, alpha=[1, 2])
    assert metadata_yaml(data.to_dict()) == data.to_yaml()


@pytest.mark.parametrize(
    "fmt,options,expected",
    [
        # an AutoFP8 source written as compressed-tensors (the default): the card names what OUTPUT is
        ("fp8", [], "compressed-tensors float-quantized (converted from AutoFP8 / vLLM fp8 (per-tensor))"),
        ("fp8", ["--format", "keep"], "AutoFP8 / vLLM fp8 (per-tensor) (as the source)"),
        ("compressed-tensors", [], "compressed-tensors float-quantized (as the source)"),
    ],
)
def test_the_card_names_the_output_format(tmp_path: Path, fmt: str, options: list[str], expected: str) -> None:
    src = build(tmp_path / "src", phi3(), fmt=fmt)
    assert run_cli("convert", src, tmp_path / "out", "-q", *options).exit_code == 0
    quant_method = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"]
    assert quant_method == ("fp8" if "keep" in options else "compressed-tensors")  # what the card must then say
    assert f"- Format: {expected}\n" in (tmp_path / "out" / "README.md").read_text()
