"""Every fix inspect suggests, run: the finding goes away, and nothing else appears unless the finding said
what the fix costs (issue 27: the shipped example's single-scale-fused finding, for vLLM <= 0.5.0, suggested
the conversion that keeps one scale; its output was told "convert cannot fix this" while one could).

Sources: every format x scale style the builders write, on the Phi-3 (both fused), GLM (gate_up fused) and
Llama (nothing fused) shapes, the shipped example, e4m3fnuz outputs, Llama-4 stacked experts; and what the
default conversion writes from each (inspecting it again must find nothing --strict fails on).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, glm, llama, phi3
from tests.conftest import run_cli
from tests.test_experts import build_llama4
from tests.test_gate import check_fixpoint
from tests.test_registry import MODELS

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "phi3-tiny-fp8"
STYLES = {
    "fp8": ("tensor", "shard", "channel"),
    "fp8-legacy": ("tensor", "shard"),
    "compressed-tensors": ("tensor", "shard", "channel"),
    "block-fp8": ("block",),
    "modelopt": ("tensor", "shard"),
    "quark": ("tensor", "shard"),
}
SHAPES = {"phi3": phi3, "glm": glm, "llama": llama, **{name: (lambda m=m: m) for name, (m, _) in MODELS.items()}}
SOURCES = [
    (shape, fmt, scale)
    for shape in SHAPES
    for fmt, scales in STYLES.items()
    for scale in scales
    if not (scale == "shard" and shape == "llama")  # Llama fuses nothing on disk
]


def inspect(folder: Path) -> dict:
    result = run_cli("inspect", folder, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def check_every_fix(src: Path, work: Path) -> int:
    """Run each finding's fix on `src`; return how many ran."""
    before = inspect(src)
    codes = {f["code"] for f in before["findings"]}
    ran = 0
    # the module findings; the gate's row findings (`loaders`) and their fixes: tests/test_gate.py
    for i, finding in enumerate(f for f in before["findings"] if f["fix"] and not f["loaders"]):
        out = work / f"fix{i}"
        result = run_cli("convert", src, out, *finding["fix"].split(), "--json")
        assert result.exit_code == 0, (finding, result.output)
        after = inspect(out)
        left = {f["code"] for f in after["findings"] if not f["loaders"]}
        assert finding["code"] not in left, (finding["code"], finding["fix"], after["findings"])
        appeared = left - codes
        if not finding["trade_off"]:
            assert not appeared, (finding["code"], finding["fix"], appeared)
        for loader in finding["trade_off"]:  # what the finding said the fix costs is what the output gets
            assert before["loaders"][loader]["verdict"] == "loads"
            assert after["loaders"][loader]["verdict"] != "loads", (finding["code"], loader)
        for loader, row in before["loaders"].items():  # and nothing else that loaded stops loading
            if row["verdict"] == "loads" and loader not in finding["trade_off"]:
                assert after["loaders"][loader]["verdict"] == "loads", (finding["code"], finding["fix"], loader)
        ran += 1
    return ran


def check_default_output(src: Path, work: Path) -> None:
    """`convert SOURCE OUTPUT`, then `inspect --strict` on OUTPUT: it fails on exactly the target rows that do
    not load OUTPUT (nothing the conversion would still improve: `test_gate.check_fixpoint`), and a module
    finding the output keeps either says how to fix it (for another target) or that convert cannot."""
    check_fixpoint(src, work, "auto")
    for finding in inspect(work / "out-auto")["findings"]:
        assert finding["loaders"] or finding["fix"] is None or not finding["default_target"], finding


@pytest.mark.parametrize("shape,fmt,scale", SOURCES)
def test_every_suggested_fix_fixes_its_finding(tmp_path: Path, shape: str, fmt: str, scale: str) -> None:
    src = build(tmp_path / "src", SHAPES[shape](), fmt=fmt, scale=scale)
    check_every_fix(src, tmp_path)
    check_default_output(src, tmp_path)


def test_the_shipped_example(tmp_path: Path) -> None:
    # raw codes in transformers; one scale for vLLM <= 0.5.0; kv-cache scales vLLM's default call leaves unused
    assert check_every_fix(EXAMPLE, tmp_path) == 3
    check_default_output(EXAMPLE, tmp_path)
    single = next(f for f in inspect(EXAMPLE)["findings"] if f["code"] == "single-scale-fused")
    assert single["fix"] and not single["default_target"]


@pytest.mark.parametrize("scale", ["tensor", "shard"])
def test_an_e4m3fnuz_output_and_its_fixes(tmp_path: Path, scale: str) -> None:
    src = build(tmp_path / "src", phi3(), scale=scale)
    assert run_cli("convert", src, tmp_path / "fnuz", "--to", "e4m3fnuz", "-q").exit_code == 0
    assert "e4m3fnuz-for-vllm" in {f["code"] for f in inspect(tmp_path / "fnuz")["findings"]}
    assert check_every_fix(tmp_path / "fnuz", tmp_path) >= 1


def test_stacked_experts_and_their_fix(tmp_path: Path) -> None:
    src = build_llama4(tmp_path / "src", "tensor")
    assert "fused-moe-experts" in {f["code"] for f in inspect(src)["findings"]}
    assert check_every_fix(src, tmp_path) >= 1
