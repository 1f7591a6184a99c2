"""--target: the layout convert writes is the one its loaders take best, judged on what it writes;
inspect --strict suggests exactly that, so applying its fix always passes it (issue 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import block_fp8_checkpoint, build, llama, mlp_linears, phi3
from tests.conftest import folder_digest, run_cli
from tests.test_gate import check_fixpoint
from tests.test_registry import MODELS

CURRENT = ("vLLM >= 0.32", "transformers")


def verdicts(folder: Path) -> dict[str, str]:
    report = json.loads(run_cli("inspect", folder, "--json").output)
    return {loader: row["verdict"] for loader, row in report["loaders"].items()}


def correct(v: dict[str, str]) -> tuple[int, int]:
    return sum(v[name] == "loads" for name in CURRENT), sum(x == "loads" for x in v.values())


SOURCES = [
    (name, fmt, scale) for name in MODELS for fmt in ("fp8", "compressed-tensors") for scale in ("tensor", "shard")
]


@pytest.mark.parametrize("name,fmt,scale", SOURCES)
def test_auto_never_loads_in_fewer_loaders_and_strict_is_a_fixpoint(
    tmp_path: Path, name: str, fmt: str, scale: str
) -> None:
    model, _ = MODELS[name]
    src = build(tmp_path / "src", model, fmt=fmt, scale=scale)
    result = run_cli("convert", src, tmp_path / "out", "--json", "-q")
    assert result.exit_code == 0, result.output
    said = {loader: row["verdict"] for loader, row in json.loads(result.stdout)["loaders"].items()}
    assert said == verdicts(tmp_path / "out")  # convert judged what it wrote, as inspect does
    assert correct(said) >= correct(verdicts(src))
    # inspect --strict on SOURCE fails on exactly its row findings (the rule: tests/test_gate.py); each fix,
    # applied, makes the rows it names load; the default output is a fixpoint (nothing left to improve)
    strict = run_cli("inspect", src, "--strict", "--json")
    gate = [f for f in json.loads(strict.stdout)["findings"] if f["loaders"]]
    assert strict.exit_code == (1 if gate else 0)
    for fix in {f["fix"] for f in gate if f["fix"]}:
        fixed = tmp_path / f"fixed{fix.replace(' ', '')}"
        assert run_cli("convert", src, fixed, *fix.split(), "-q").exit_code == 0
        after = verdicts(fixed)
        assert all(after[row] == "loads" for f in gate if f["fix"] == fix for row in f["loaders"]), (fix, after)
    check_fixpoint(src, tmp_path, "auto")


def test_chatglm_single_scale_is_kept_and_strict_passes(tmp_path: Path) -> None:
    """Issue 11 item 2: a single-scale ChatGLM source already loads in vLLM >= 0.5.1; the default used to
    write per-shard (fails in 3 of 4 loaders) and --strict could never pass. (compressed-tensors: an
    AutoFP8 source would be rewritten as compressed-tensors for transformers.)"""
    src = build(tmp_path / "src", MODELS["chatglm-mqa"][0], fmt="compressed-tensors")
    result = json.loads(run_cli("convert", src, tmp_path / "out", "--json", "-q").output)
    assert result["layout"] == "fused" and {m["action"] for m in result["modules"]} == {"keep"}
    gate = [f for f in json.loads(run_cli("inspect", src, "--json").stdout)["findings"] if f["loaders"]]
    assert not [f for f in gate if f["code"] == "row-improved"]  # the default keeps it: nothing to improve
    per_shard = tmp_path / "per-shard"
    assert run_cli("convert", src, per_shard, "--layout", "per-shard", "-q").exit_code == 0
    assert verdicts(per_shard)["vLLM >= 0.32"] == "fails"
    strict = run_cli("inspect", per_shard, "--strict", "--json")
    assert strict.exit_code == 1
    assert "--layout fused" in {f["fix"] for f in json.loads(strict.stdout)["findings"] if f["loaders"]}


def test_glm_unfused_is_refused_by_vllms_transformers_backend(tmp_path: Path) -> None:
    """Issue 11 item 1: vLLM 0.32 serves GlmForCausalLM through TransformersForCausalLM, which has only
    gate_up_proj (vllm/model_executor/models/registry.py _TRANSFORMERS_SUPPORTED_MODELS)."""
    src = build(tmp_path / "src", MODELS["glm"][0])
    unfused = json.loads(run_cli("convert", src, tmp_path / "u", "--layout", "unfused", "--json", "-q").output)
    row = unfused["loaders"]["vLLM >= 0.32"]
    assert row["verdict"] == "fails" and "Transformers backend" in row["reason"]
    assert "_TRANSFORMERS_SUPPORTED_MODELS" in row["evidence"]
    auto = json.loads(run_cli("convert", src, tmp_path / "a", "--json", "-q").output)
    assert auto["layout"] == "fused" and auto["loaders"]["vLLM >= 0.32"]["verdict"] == "loads"


@pytest.mark.parametrize(
    "target,layout", [("auto", "fused"), ("vllm", "unfused"), ("vllm-legacy", "unfused"), ("transformers", "fused")]
)
def test_each_target_picks_what_its_loader_takes(tmp_path: Path, target: str, layout: str) -> None:
    """compressed-tensors Phi-3 with one scale per fused module: transformers loads only the fused names,
    vLLM >= 0.20 every layout but per-shard (a tie its loaders break towards unfused), vLLM <= 0.5.0
    unfused and per-shard; auto counts both current loaders, which take only fused."""
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors")
    result = json.loads(run_cli("convert", src, tmp_path / "out", "--target", target, "--json", "-q").output)
    assert result["layout"] == layout and result["target"] == target


def test_an_explicit_layout_is_obeyed_and_its_losses_are_shown(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors")
    result = run_cli("convert", src, tmp_path / "out", "--layout", "per-shard", "--target", "transformers")
    assert result.exit_code == 0, result.output
    assert "layout:  per-shard (chosen)" in result.output
    assert "transformers: cannot convert a fused module's per-shard scale vector" in result.output
    assert "(SOURCE: loads)" in result.output


def test_a_source_that_already_loads_everywhere_is_said_so_and_written(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors")
    result = run_cli("convert", src, tmp_path / "out")
    assert result.exit_code == 0 and (tmp_path / "out" / "config.json").is_file()
    said = "SOURCE already loads correctly in vLLM 0.19 - 0.20, vLLM 0.21 - 0.31, vLLM >= 0.32 and transformers"
    assert said in result.output.replace("\n      ", " ")
    fp8 = build(tmp_path / "fp8", phi3())  # AutoFP8: transformers computes with raw codes
    assert "already loads" not in run_cli("convert", fp8, tmp_path / "out2").output


def _without_fused_modules(root: Path, kind: str) -> Path:
    if kind == "block":
        config = {**llama().config, "hidden_size": 256, "intermediate_size": 256}
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
        linears = {k: v for i in range(2) for k, v in mlp_linears(f"model.layers.{i}", 256, 256).items()}
        return block_fp8_checkpoint(root, config, linears)
    fmt, scale = kind.split("/")
    return build(root, llama(), fmt=fmt, scale=scale)


@pytest.mark.parametrize("kind", ["fp8/tensor", "fp8/channel", "compressed-tensors/tensor", "block"])
def test_layouts_planned_once_where_nothing_is_fused(tmp_path: Path, kind: str) -> None:
    """Issue 25 H5: --target plans per-shard and fused only where something is fused, since without a fused
    module they write what unfused writes (and lose ties to it). Written out here, they do: same files,
    byte for byte, model card aside (it names the layout); and the automatic choice is unfused."""
    src = _without_fused_modules(tmp_path / "src", kind)
    written = {}
    for layout in ("unfused", "per-shard", "fused"):
        out = tmp_path / layout
        result = run_cli("convert", src, out, "--layout", layout, "-q")
        assert result.exit_code == 0, result.output
        written[layout] = {k: v for k, v in folder_digest(out).items() if k != "README.md"}
    assert written["unfused"] == written["per-shard"] == written["fused"]
    assert len(written["unfused"]) > 2
    chosen = json.loads(run_cli("convert", src, tmp_path / "auto", "--json", "-q").output)
    assert chosen["layout"] in ("unfused", "channel")
