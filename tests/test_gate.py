"""Every answer agrees with the rows (issue 47): `inspect --strict`'s exit code, its row findings, each
finding's fix and convert's default plan, at breadth.

The rule is stated here, not imported: a gate for a target fails exactly when one of the target's rows
(written out below from the docs, not from fp8fix's tables) does not `loads` SOURCE, or when the default
`convert --target TARGET` makes a row load that does not load SOURCE and costs no row that does. Each row
finding names such rows; a fix it gives, planned (`convert --dry-run` with those options), makes each
named row load; a finding without a fix is one the default conversion leaves unloaded. Converting with
the default and inspecting OUTPUT again is a fixpoint: nothing left that the conversion would improve.

Sources: every format x scale style the builders write on the Phi-3 (both fused), GLM (gate_up fused) and
Llama (nothing fused) shapes and the registry's other models, FBGEMM, architecture names no runtime knows,
the `--to e4m3fnuz` outputs of every shape, and FP4 and mixed checkpoints (NVFP4 global scales shared by packed
projections or each their own, which the default conversion gives one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import build, fp4_compressed_tensors, glm, llama, modelopt_mixed, modelopt_nvfp4, phi3
from tests.conftest import run_cli
from tests.test_registry import MODELS

#: The rows each --target gates on (docs/usage.md, `--target`): auto is every vLLM since 0.19 and transformers.
VLLM_SINCE_019 = ("vLLM 0.19 - 0.20", "vLLM 0.21 - 0.31", "vLLM >= 0.32")
TARGET_ROWS = {
    "auto": (*VLLM_SINCE_019, "transformers"),
    "vllm": VLLM_SINCE_019,
    "transformers": ("transformers",),
    "vllm-legacy": ("vLLM <= 0.5.0",),
}
STYLES = {
    "fp8": ("tensor", "shard", "channel"),
    "fp8-legacy": ("tensor",),
    "compressed-tensors": ("tensor", "shard", "channel"),
    "block-fp8": ("block",),
    "modelopt": ("tensor", "shard"),
    "quark": ("tensor", "shard"),
    "fbgemm": ("channel",),
}
SHAPES = {"phi3": phi3, "glm": glm, "llama": llama}
SOURCES = [
    (shape, fmt, scale)
    for shape in SHAPES
    for fmt, scales in STYLES.items()
    for scale in scales
    if not (scale == "shard" and shape == "llama")
]
#: The registry's other models, in the two formats whose rows differ most (AutoFP8, compressed-tensors).
OTHER_MODELS = [(name, fmt) for name in MODELS if name not in SHAPES for fmt in ("fp8", "compressed-tensors")]
#: config.json names no runtime knows: a typo of a fused model, a typo of an unfused one, a made-up name.
UNKNOWN_NAMES = {"phi3": "Phi3ForCasualLM", "llama": "LlamaForCausalLm", "glm": "NoSuchModelForCausalLM"}


def inspect(folder: Path, target: str) -> dict:
    result = run_cli("inspect", folder, "--json", "--target", target)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def dry_run(folder: Path, out: Path, *options: str) -> dict | None:
    """`convert --dry-run --json`'s report, or None where convert refuses SOURCE."""
    result = run_cli("convert", folder, out, "--dry-run", "--json", *options)
    report = json.loads(result.stdout)
    return report if result.exit_code == 0 else None


def expected_rows(rows: dict, planned: dict | None, target: str) -> set[str]:
    """The rule, from the rows alone."""
    wanted = TARGET_ROWS[target]
    free = planned is not None and not any(  # the default conversion costs no row that loads SOURCE
        row["verdict"] == "loads" and planned[name]["verdict"] != "loads" for name, row in rows.items()
    )
    return {
        name
        for name, row in rows.items()
        if row["verdict"] != "loads" and (name in wanted or (free and planned[name]["verdict"] == "loads"))
    }


def check_gate(folder: Path, work: Path, target: str) -> dict:
    """Rows, findings, exit code, fixes and the default plan agree for `target`; return inspect's report."""
    report = inspect(folder, target)
    rows = report["loaders"]
    aimed = () if target == "auto" else ("--target", target)
    plan = dry_run(folder, work / "dry", *aimed)
    planned = plan["loaders"] if plan is not None else None
    if plan is not None:  # convert judges SOURCE as inspect does
        judged = {k: v["verdict"] for k, v in plan["source_loaders"].items()}
        assert judged == {k: v["verdict"] for k, v in rows.items()}
    expected = expected_rows(rows, planned, target)
    gate = [f for f in report["findings"] if f["loaders"]]
    named = [name for f in gate for name in f["loaders"]]
    assert sorted(named) == sorted(expected), (target, named, expected)
    strict = run_cli("inspect", folder, "--strict", "-q", "--target", target)
    assert strict.exit_code == (1 if expected else 0), (target, expected, strict.output)
    for finding in gate:
        for name in finding["loaders"]:
            assert rows[name]["verdict"] != "loads"
            code = f"row-{rows[name]['verdict']}" if name in TARGET_ROWS[target] else "row-improved"
            assert finding["code"] == code, (finding, name)
        if finding["fix"] is None:  # the default conversion leaves these rows as they are
            assert planned is None or all(planned[n]["verdict"] != "loads" for n in finding["loaders"]), finding
            continue
        fixed = dry_run(folder, work / "fix", *finding["fix"].split())
        assert fixed is not None, finding
        for name in finding["loaders"]:
            assert fixed["loaders"][name]["verdict"] == "loads", (finding, name)
        for name in finding["trade_off"]:  # the price it names: loads now, not after
            assert rows[name]["verdict"] == "loads" and fixed["loaders"][name]["verdict"] != "loads", finding
    return report


def check_fixpoint(folder: Path, work: Path, target: str) -> None:
    """The default conversion's OUTPUT: nothing left that converting it again would improve, and its gate
    fails exactly on the target's rows that do not load it."""
    aimed = () if target == "auto" else ("--target", target)
    out = work / f"out-{target}"
    if run_cli("convert", folder, out, "-q", *aimed).exit_code != 0:
        return  # convert refuses SOURCE: nothing written, nothing to inspect
    report = check_gate(out, work / f"again-{target}", target)
    assert not [f for f in report["findings"] if f["code"] == "row-improved"], report["findings"]


@pytest.mark.parametrize("shape,fmt,scale", SOURCES)
def test_gate_agrees_with_the_rows(tmp_path: Path, shape: str, fmt: str, scale: str) -> None:
    src = build(tmp_path / "src", SHAPES[shape](), fmt=fmt, scale=scale)
    for target in TARGET_ROWS:
        check_gate(src, tmp_path / target, target)
    for target in ("auto", "vllm"):
        check_fixpoint(src, tmp_path, target)


_QKV_NVFP4 = {"self_attn.q_proj": "nvfp4", "self_attn.k_proj": "nvfp4", "self_attn.v_proj": "nvfp4", "proj": "fp8"}
#: FP4 and mixed sources (issue 49), by name: builders of a folder.
FP4_SOURCES = {
    "ct-nvfp4": lambda root: fp4_compressed_tensors(root, {"proj": "nvfp4"}),
    "ct-nvfp4-own-global": lambda root: fp4_compressed_tensors(root, {"proj": "nvfp4"}, shared_global=False),
    "ct-mxfp4-phi3": lambda root: fp4_compressed_tensors(root, {"proj": "mxfp4"}, phi3()),
    "ct-mixed-own-global": lambda root: fp4_compressed_tensors(root, _QKV_NVFP4, shared_global=False),
    "modelopt-nvfp4-own": lambda root: modelopt_nvfp4(root, shared_global=False),
    "modelopt-mixed-own": lambda root: modelopt_mixed(root, _QKV_NVFP4, shared_global=False),
}


@pytest.mark.parametrize("name", FP4_SOURCES)
def test_gate_agrees_on_fp4_checkpoints(tmp_path: Path, name: str) -> None:
    src = FP4_SOURCES[name](tmp_path / "src")
    for target in TARGET_ROWS:
        check_gate(src, tmp_path / target, target)
    for target in ("auto", "transformers"):
        check_fixpoint(src, tmp_path, target)


@pytest.mark.parametrize("name,fmt", OTHER_MODELS)
def test_gate_agrees_on_the_registry_models(tmp_path: Path, name: str, fmt: str) -> None:
    src = build(tmp_path / "src", MODELS[name][0], fmt=fmt)
    for target in ("auto", "vllm-legacy"):
        check_gate(src, tmp_path / target, target)
    check_fixpoint(src, tmp_path, "auto")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_unknown_architecture_name_fails_the_gate(tmp_path: Path, shape: str) -> None:
    src = build(tmp_path / "src", SHAPES[shape](), fmt="compressed-tensors")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = [UNKNOWN_NAMES[shape]]
    (src / "config.json").write_text(json.dumps(config))
    report = check_gate(src, tmp_path / "auto", "auto")
    for row in VLLM_SINCE_019:
        assert report["loaders"][row]["verdict"] == "fails", report["loaders"][row]
        assert "are not supported for now" in report["loaders"][row]["reason"]
    assert "transformers" not in {n for f in report["findings"] for n in f["loaders"]}  # it reads model_type
    if shape == "phi3":  # a typo of a registered name: the nearest is named
        assert "nearest name vLLM registers: Phi3ForCausalLM" in report["loaders"]["vLLM >= 0.32"]["reason"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fbgemm_converts_to_compressed_tensors_channel(tmp_path: Path, shape: str) -> None:
    src = build(tmp_path / "src", SHAPES[shape](), fmt="fbgemm", scale="channel", static_input=False)
    before = check_gate(src, tmp_path / "gate", "auto")
    assert all(f["fix"] for f in before["findings"] if f["loaders"])  # every row: the default conversion
    assert run_cli("convert", src, tmp_path / "out", "-q").exit_code == 0  # run_cli verifies it
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (config["quant_method"], weights["strategy"]) == ("compressed-tensors", "channel")
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    after = inspect(tmp_path / "out", "auto")
    assert all(after["loaders"][row]["verdict"] == "loads" for row in TARGET_ROWS["auto"]), after["loaders"]
    source_files = {p.name: p.read_bytes() for p in src.glob("*.safetensors")}
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.safetensors")}
    assert source_files == written  # a rename of the config: every tensor byte-identical


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("options", [("--to", "e4m3fnuz"), ("--layout", "fused", "--to", "e4m3fnuz")])
def test_e4m3fnuz_outputs_say_who_they_are_not_for(tmp_path: Path, shape: str, options: tuple[str, ...]) -> None:
    src = build(tmp_path / "src", SHAPES[shape](), fmt="compressed-tensors")
    result = run_cli("convert", src, tmp_path / "out", "--json", *options)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    loads_somewhere = any(v["verdict"] == "loads" for v in report["loaders"].values())
    said = [w for w in report["warnings"] if w.startswith("no loader fp8fix judges loads OUTPUT exactly")]
    assert bool(said) == (not loads_somewhere), (report["loaders"], report["warnings"])
    assert not said or "serve the e4m3fn checkpoint" in said[0]
    gate = check_gate(tmp_path / "out", tmp_path / "gate", "auto")  # the output as a SOURCE: its gate agrees too
    # every target row rounds it, and converting back to e4m3fn is the fix, for each of them (judged as written:
    # the candidates of `--to e4m3fn` are planned with the encoding, not on the e4m3fnuz rows)
    rounded = [f for f in gate["findings"] if f["code"] == "row-rounded"]
    assert {n for f in rounded for n in f["loaders"]} == set(TARGET_ROWS["auto"]), gate["findings"]
    assert {f["fix"] for f in rounded} == {"--to e4m3fn"}, rounded
    back = dry_run(tmp_path / "out", tmp_path / "back", "--to", "e4m3fn")
    assert back is not None and all(back["loaders"][row]["verdict"] == "loads" for row in TARGET_ROWS["auto"])
