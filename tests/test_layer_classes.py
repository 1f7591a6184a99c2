"""`--target` judges its candidates on one layer of each class (issue 30): the verdicts, formats, losses and
the choice must be what judging the whole checkpoint gives, across every builder architecture x format x scale
style, with layers that are alike and with one layer unlike the others.

The oracle is the same candidates planned on the whole checkpoint (`by_class=False`), the way every command
judged them before; the checkpoints are real files whose scales are rewritten by torch here.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8fix.errors import Fp8fixError
from fp8fix.io.checkpoint import open_checkpoint
from fp8fix.model import CheckpointModel, describe_checkpoint
from fp8fix.plan.layer_classes import MOST_CONFIG_ITEMS, representatives
from fp8fix.plan.targets import TARGET_LOADERS, Candidate, best, candidates
from fp8fix.registry.architectures import Registry
from fp8fix.verdicts import verdicts_json
from fp8fix.vocab import Layout
from tests.builders import FORMATS, build, llama, mimo_v2, phi3
from tests.conftest import load_tensors, run_cli
from tests.test_experts import build_llama4
from tests.test_registry import MODELS

LAYERS = 16
ODD = 5  # the layer unlike the others
ARCHITECTURES = {**{name: model for name, (model, _) in MODELS.items()}, "llama": llama()}
SCALE_STYLES = ("tensor", "shard", "channel")
_NUMBER = re.compile(r"\.(\d+)\.")


def describe(root: Path) -> CheckpointModel:
    return describe_checkpoint(open_checkpoint(root), Registry.builtin())


def _is_scale(name: str) -> bool:
    return name.endswith(("scale", "scale_inv"))


def rewrite_scales(root: Path, change: Any) -> None:
    """Every shard of `root` rewritten with `change(name, tensor)` applied to each scale tensor (safetensors
    files as `save_file` writes them; the index still names the same file for every tensor)."""
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        tensors = {name: change(name, t) if _is_scale(name) else t for name, t in tensors.items()}
        save_file(tensors, str(path), metadata={"format": "pt"})


def layers_alike(root: Path) -> None:
    """Each layer's scales copied from the lowest layer's scale of the same name and shape."""
    first: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    everything = load_tensors(root)
    for name in sorted(everything, key=lambda n: int(m.group(1)) if (m := _NUMBER.search(n)) else -1):
        first.setdefault((_NUMBER.sub(".#.", name, count=1), tuple(everything[name].shape)), everything[name])

    def change(name: str, t: torch.Tensor) -> torch.Tensor:
        return first[(_NUMBER.sub(".#.", name, count=1), tuple(t.shape))].clone()

    rewrite_scales(root, change)


def one_layer_differs(root: Path) -> None:
    """Every scale set to 2^-7 (every shard of a fused module alike), but layer `ODD`'s, as exported."""

    def change(name: str, t: torch.Tensor) -> torch.Tensor:
        if f".{ODD}." in name:
            return t
        return torch.full(t.shape, 2.0**-7).to(t.dtype)

    rewrite_scales(root, change)


def small_values(root: Path, layer: int) -> set[float]:
    """The distinct values of `layer`'s scales of at most 64 values."""
    found: set[float] = set()
    for name, t in load_tensors(root).items():
        if _is_scale(name) and f".{layer}." in name and t.numel() <= 64:
            found.update(t.float().flatten().tolist())
    return found


VARIANTS = {"layers-alike": layers_alike, "one-layer-differs": one_layer_differs}


def summary(found: list[Candidate]) -> dict[tuple[str, str], tuple[bool, bool, Any]]:
    return {(c.layout, c.output_format): (c.unchanged, c.lossy, verdicts_json(c.plan.loaders)) for c in found}


def judged(root: Path, by_class: bool) -> list[Candidate] | str:
    """The candidates `--target` judges (planned on the whole checkpoint or by class), or the error."""
    model = describe(root)
    try:
        model.require_convertible()
        return candidates(model, by_class=by_class)
    except Fp8fixError as e:
        return str(e)


def default_layout(root: Path) -> Layout:
    return describe(root).require_architecture()[1].default_layout


def assert_judged_alike(root: Path) -> tuple[list[Candidate], list[Candidate]]:
    """The same candidates, verdicts, losses and choice for every target either way (or the same error)."""
    whole, by_class = judged(root, by_class=False), judged(root, by_class=True)
    if isinstance(whole, str) or isinstance(by_class, str):
        assert by_class == whole
        return [], []
    assert summary(by_class) == summary(whole)
    if whole:
        default = default_layout(root)
        for target in TARGET_LOADERS:
            a, b = best(whole, target, default), best(by_class, target, default)
            assert (b.layout, b.output_format) == (a.layout, a.output_format), target
    return whole, by_class


def _matrix() -> list[tuple[str, str, str]]:
    rows = []
    for arch in ARCHITECTURES:
        for fmt, spec in FORMATS.items():
            for scale in ("block",) if spec.block else SCALE_STYLES:
                if arch == "llama" and scale == "shard":
                    continue  # nothing fused: no shard scales
                rows.append((arch, fmt, scale))
    return rows


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("arch", "fmt", "scale"), _matrix())
def test_candidates_judged_by_class_are_judged_as_whole(
    tmp_path: Path, arch: str, fmt: str, scale: str, variant: str
) -> None:
    model = replace(ARCHITECTURES[arch], layers=LAYERS)
    root = build(tmp_path / "src", model, fmt=fmt, scale="tensor" if scale == "block" else scale)
    VARIANTS[variant](root)
    whole, by_class = assert_judged_alike(root)
    if not whole:
        return
    fused = arch != "llama"
    plain_without_channel = not fused and FORMATS[fmt].block is not None  # FBGEMM: channel via compressed-tensors
    engaged = not (fused and scale == "channel") and not plain_without_channel
    assert all(c.whole for c in by_class) != engaged  # reduced exactly where it saves planning
    if engaged:
        reduced = representatives(describe(root))
        assert reduced is not None
        kept = {m.group(1) for name in reduced.checkpoint.tensors if (m := _NUMBER.search(name))}
        assert len(kept) < LAYERS // 2
        if variant == "one-layer-differs":  # kept where its values differ among themselves (others' do not)
            assert (str(ODD) in kept) == (len(small_values(root, ODD)) > 1)


def test_the_one_layer_whose_shard_scales_differ_decides_the_layout(tmp_path: Path) -> None:
    """Phi-3 compressed-tensors with per-shard scales: alike in every layer but one. Only that layer's shards
    differ, so only `channel` keeps every weight: judged by class, it must still be chosen, and convert writes it."""
    root = build(tmp_path / "src", replace(phi3(), layers=LAYERS), fmt="compressed-tensors", scale="shard")
    one_layer_differs(root)
    whole, by_class = assert_judged_alike(root)
    assert not all(c.whole for c in by_class)
    assert best(by_class, "auto", default_layout(root)).layout == "channel"
    out = run_cli("convert", root, tmp_path / "out", "--dry-run", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["layout"] == "channel"
    # and the layer is what decides it: with every layer alike, nothing differs and channel is not chosen
    alike = build(tmp_path / "alike", replace(phi3(), layers=LAYERS), fmt="compressed-tensors", scale="shard")
    rewrite_scales(alike, lambda name, t: torch.full(t.shape, 2.0**-7).to(t.dtype))
    found = judged(alike, by_class=True)
    assert not isinstance(found, str)
    assert best(found, "auto", default_layout(alike)).layout != "channel"


def _with_ignore_entry(root: Path, entry: str) -> None:
    path = root / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["ignored_layers"].append(entry)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "entry", [r"re:model\.layers\.6\.self_attn\..*", "model.layers.6.self_attn.qkv_pro?", "model.layers.[6].mlp"]
)
def test_a_config_pattern_holding_a_number_means_no_classes(tmp_path: Path, entry: str) -> None:
    root = build(tmp_path / "src", replace(phi3(), layers=LAYERS))
    layers_alike(root)
    assert representatives(describe(root)) is not None
    _with_ignore_entry(root, entry)
    assert representatives(describe(root)) is None
    assert_judged_alike(root)


def test_a_layer_a_config_name_holds_is_its_own_class(tmp_path: Path) -> None:
    """An `ignored_layers` entry naming layer 6's FP8 qkv_proj (a config that disagrees with the tensors):
    layer 6 is judged on its own, and the verdicts are the whole checkpoint's."""
    root = build(tmp_path / "src", replace(phi3(), layers=LAYERS))
    layers_alike(root)
    _with_ignore_entry(root, "model.layers.6.self_attn.qkv_proj")
    reduced = representatives(describe(root))
    assert reduced is not None
    assert any(".6." in name for name in reduced.checkpoint.tensors)
    assert not any(".7." in name for name in reduced.checkpoint.tensors)
    assert_judged_alike(root)


def test_mimo_chunks_by_class(tmp_path: Path) -> None:
    root = mimo_v2(tmp_path / "mimo", layers=LAYERS)
    whole, by_class = assert_judged_alike(root)
    assert whole


@pytest.mark.parametrize("scale", ["tensor", "expert", "shard", "channel"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stacked_experts_by_class(tmp_path: Path, scale: str, variant: str) -> None:
    root = build_llama4(tmp_path / "l4", scale, layers=LAYERS)
    VARIANTS[variant](root)
    whole, by_class = assert_judged_alike(root)
    assert whole


def test_headers_only_or_two_layers_are_not_reduced(tmp_path: Path) -> None:
    root = build(tmp_path / "two", phi3())
    assert representatives(describe(root)) is None  # two layers: nothing to gain
    many = build(tmp_path / "many", replace(phi3(), layers=LAYERS))
    layers_alike(many)
    ckpt = open_checkpoint(many)
    ckpt.has_data = False  # as from the Hub: no scale values to class by
    assert representatives(describe_checkpoint(ckpt, Registry.builtin())) is None


def test_an_invalid_small_scale_means_no_classes(tmp_path: Path) -> None:
    root = build(tmp_path / "src", replace(phi3(), layers=LAYERS))
    layers_alike(root)
    rewrite_scales(root, lambda name, t: torch.zeros_like(t) if ".9.mlp.gate_up_proj.weight_scale" in name else t)
    assert representatives(describe(root)) is None
    assert isinstance(judged(root, by_class=True), str)  # the zero scale is refused by name, either way


def test_a_config_too_big_to_walk_means_no_classes(tmp_path: Path) -> None:
    """config.json strings are walked for layer numbers up to a bound: past it, every layer is judged (and a
    long run of digits is split, never one huge number)."""
    root = build(tmp_path / "src", replace(phi3(), layers=LAYERS))
    layers_alike(root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "notes": "9" * 1_000_000}))
    assert representatives(describe(root)) is not None
    (root / "config.json").write_text(json.dumps({**config, "notes": [f"x{i}" for i in range(MOST_CONFIG_ITEMS)]}))
    assert representatives(describe(root)) is None
    assert_judged_alike(root)
