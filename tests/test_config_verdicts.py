"""What config.json alone decides (issue 47): an architecture name vLLM resolves to no model class, and a
Phi-3 config whose LongRoPE factor lists do not fit. The real loaders' side: tests/loaders/test_config_refusals.py.

The expectations come from the loaders' code as the docstrings cite it, not from fp8fix's tables: vLLM's
resolution order (vllm 0.32 model_executor/models/registry.py inspect_model_cls) and transformers'
Phi3Config.validate_rope (rotary dimension = hidden_size // num_attention_heads x partial_rotary_factor).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8fix.registry.vllm_names import nearest_vllm_name, vllm_resolves
from fp8fix.verdicts import rope_misfit
from tests.builders import build, llama, phi3
from tests.conftest import run_cli

VLLM_ROWS = ("vLLM <= 0.5.0", "vLLM 0.5.1 - 0.18", "vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32")
EVERY_ROW = (*VLLM_ROWS, "vLLM >= 0.32 on ROCm", "SGLang 0.5.23", "transformers")


def rows(folder: Path) -> dict[str, dict]:
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["loaders"]


def with_config(folder: Path, **keys: object) -> Path:
    config = {**json.loads((folder / "config.json").read_text()), **keys}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "name,config,resolves",
    [
        ("Phi3ForCausalLM", {}, True),  # registered
        ("Phi3ForCasualLM", {}, False),  # a typo
        ("NoSuchModelForCausalLM", {}, False),
        ("Phi3ForSequenceClassification", {}, True),  # the suffix swaps to a registered name
        ("MyOwnForCausalLM", {"auto_map": {"AutoModelForCausalLM": "modeling_my.MyOwnForCausalLM"}}, True),
        ("MyOwnForCausalLM", {"auto_map": {"AutoConfig": "configuration_my.MyConfig"}}, False),  # no AutoModel
        ("BaichuanForCausalLM", {}, True),  # removed: refused with its own message (vllm_removed_architecture)
    ],
)
def test_which_names_vllm_resolves(name: str, config: dict, resolves: bool) -> None:
    assert vllm_resolves(name, config) is resolves


def test_a_transformers_class_vllm_does_not_register_resolves_through_its_backend() -> None:
    data = json.loads(
        (Path(__file__).resolve().parent.parent / "fp8fix/registry/runtimes/vllm-architectures.json").read_text()
    )
    name = next(n for n in data["transformers_classes"] if n.endswith("ForCausalLM"))
    assert name not in data["registered"] and vllm_resolves(name, {})


def test_the_nearest_name_is_a_hint_for_typos_only() -> None:
    assert nearest_vllm_name("Phi3ForCasualLM") == "Phi3ForCausalLM"
    assert nearest_vllm_name("Qwen9Foo") is None


@pytest.mark.parametrize("model", [phi3, llama])
def test_an_unknown_name_fails_every_vllm_row_and_not_transformers(tmp_path: Path, model) -> None:
    src = build(tmp_path / "src", model(), fmt="compressed-tensors")
    before = rows(src)
    with_config(src, architectures=["Phi3ForCasualLM" if model is phi3 else "LlamaForCausalLm"])
    after = rows(src)
    for row in (*VLLM_ROWS, "vLLM >= 0.32 on ROCm"):
        assert after[row]["verdict"] == "fails" and "are not supported for now" in after[row]["reason"], row
    assert after["transformers"]["verdict"] == before["transformers"]["verdict"]  # it reads model_type


def test_a_plain_model_with_an_unknown_name_fails_in_vllm(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="compressed-tensors")
    assert run_cli("convert", src, tmp_path / "bf16", "--to", "bf16", "-q").exit_code == 0
    with_config(tmp_path / "bf16", architectures=["Phi3ForCasualLM"])
    assert rows(tmp_path / "bf16")["vLLM >= 0.32"]["verdict"] == "fails"


def longrope(length: int, partial: float | None = None) -> dict[str, object]:
    rope: dict[str, object] = {"type": "longrope", "short_factor": [1.0] * length, "long_factor": [1.5] * length}
    keys: dict[str, object] = {"original_max_position_embeddings": 4096, "max_position_embeddings": 131072}
    if partial is not None:
        keys["partial_rotary_factor"] = partial
    return {**keys, "rope_scaling": rope}


@pytest.mark.parametrize(
    "keys,misfit",
    [
        (longrope(8), ""),  # hidden 64 / 4 heads = 16: 8 factors
        (longrope(48), "short_factor has 48 values where its rotary dimension needs 8"),  # Phi-3-mini-128k's lists
        (longrope(4, partial=0.5), ""),  # rotary dimension 8: 4 factors
        (longrope(8, partial=0.5), "short_factor has 8 values where its rotary dimension needs 4"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": "x"}},
            "long_factor has a str",
        ),
        ({"rope_scaling": None}, ""),
    ],
)
def test_a_phi3_rope_config_that_does_not_fit_fails_every_row(tmp_path: Path, keys: dict, misfit: str) -> None:
    src = with_config(build(tmp_path / "src", phi3(), fmt="compressed-tensors"), **keys)
    assert rope_misfit(json.loads((src / "config.json").read_text())).startswith(misfit)
    said = rows(src)
    for row in EVERY_ROW:  # refused as the config is read, whatever else the checkpoint holds
        refused = said[row]["verdict"] == "fails" and "rope_scaling" in said[row]["reason"]
        assert refused == bool(misfit), (row, said[row])
    if misfit:
        assert misfit in said["transformers"]["reason"]


def test_the_rope_check_is_phi3s(tmp_path: Path) -> None:
    """Other model types validate LongRoPE lists with a warning only (modeling_rope_utils): not predicted."""
    src = with_config(build(tmp_path / "src", llama(), fmt="compressed-tensors"), **longrope(48))
    assert rows(src)["transformers"]["verdict"] == "loads"


@pytest.mark.parametrize(
    "rope",
    [
        {"partial_rotary_factor": float("nan")},
        {"partial_rotary_factor": float("inf")},
        {"partial_rotary_factor": 1e308},
    ],
)
def test_a_hostile_rotary_factor_is_no_refusal_and_no_crash(tmp_path: Path, rope: dict) -> None:
    """NaN, Infinity (config.json may hold them) or a factor that overflows: no length fits, so nothing is predicted
    (int() of them raised inside inspect before: exit 70)."""
    keys = longrope(8)
    keys["rope_scaling"] = {**keys["rope_scaling"], **rope}  # type: ignore[dict-item]
    assert rope_misfit({**phi3().config, **keys}) == ""
    src = with_config(build(tmp_path / "src", phi3(), fmt="compressed-tensors"), **keys)
    assert run_cli("inspect", src, "--strict", "-q").exit_code in (0, 1)
