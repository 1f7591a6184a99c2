"""Issue 25: verify as an independent witness of what convert wrote beside the weights.

verify no longer asks convert's config code what config.json should be; it reads both configs
and checks what loaders take from them. Each test here makes one faithful conversion, changes
one thing a loader would read differently (or a file fp8fix writes that verify never looked
at: shard `__metadata__`, index keys), and expects verify to name it. The changes are made
by hand from the formats' own definitions, never with fp8fix's code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import build, llama, phi3
from tests.conftest import run_cli

INDEX = "model.safetensors.index.json"


def convert(tmp_path: Path, model: Any = phi3, *options: str, **build_options: Any) -> tuple[Path, Path]:
    src = build(tmp_path / "src", model(), **build_options)
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "-q", *options)
    assert result.exit_code == 0, result.output
    return src, out


def edit(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def problems(src: Path, out: Path) -> str:
    result = run_cli("verify", src, out)
    assert result.exit_code == 1, result.output
    return result.output


def _other(qc: dict[str, Any]) -> str:
    """The weight strategy the config does not say (tensor <-> channel)."""
    return {"tensor": "channel", "channel": "tensor"}[qc["config_groups"]["group_0"]["weights"]["strategy"]]


def quantization(out: Path) -> dict[str, Any]:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_a_faithful_unfused_conversion_passes(tmp_path: Path) -> None:
    src, out = convert(tmp_path, phi3, "--layout", "unfused", "--format", "keep")
    assert run_cli("verify", src, out, "-q").exit_code == 0


def test_a_renamed_list_that_names_more_modules_is_caught(tmp_path: Path) -> None:
    """Text may differ after a rename; meaning may not: an entry that also names q_proj is caught."""
    src, out = convert(tmp_path, phi3, "--layout", "unfused", "--format", "keep")
    edit(
        out / "config.json", lambda c: c["quantization_config"]["ignored_layers"].append("model.layers.0.mlp.down_proj")
    )
    assert "ignored_layers: names other modules" in problems(src, out)
    assert "also model.layers.0.mlp.down_proj" in problems(src, out)


def test_a_renamed_list_that_forgets_a_shard_is_caught(tmp_path: Path) -> None:
    src, out = convert(
        tmp_path,
        phi3,
        "--layout",
        "unfused",
        "--format",
        "keep",
        ignore=["lm_head", "model.layers.1.self_attn.qkv_proj"],
    )
    named = quantization(out)["ignored_layers"]
    assert "model.layers.1.self_attn.k_proj" in named  # the rename, as vLLM reads shard names
    edit(
        out / "config.json",
        lambda c: c["quantization_config"].__setitem__(
            "ignored_layers", [e for e in named if e != "model.layers.1.self_attn.k_proj"]
        ),
    )
    assert "not model.layers.1.self_attn.k_proj" in problems(src, out)


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy=_other(q)), "weight scales"),
        (lambda q: q["config_groups"]["group_0"]["input_activations"].__setitem__("dynamic", True), "static"),
        (lambda q: q.pop("kv_cache_scheme"), "kv_cache_scheme missing"),
        (lambda q: q["ignore"].append("model.layers.0.mlp.down_proj"), "does not skip the FP8 modules"),
        (lambda q: q.__setitem__("ignore", []), "targets 1 Linear module(s) OUTPUT holds no FP8 weight"),
        (lambda q: q["config_groups"]["group_0"].__setitem__("targets", ["Attention"]), "targeting Linear"),
    ],
    ids=["strategy", "dynamic-input", "no-kv-scheme", "ignores-fp8", "quantizes-lm-head", "targets"],
)
def test_a_compressed_tensors_config_is_read_against_the_tensors(
    tmp_path: Path, change: Callable[[Any], Any], said: str
) -> None:
    """AutoFP8 written as compressed-tensors: what the config says is checked against OUTPUT's tensors."""
    src, out = convert(tmp_path, llama, "--format", "compressed-tensors")
    assert quantization(out)["ignore"] == ["lm_head"]
    edit(out / "config.json", lambda c: change(c["quantization_config"]))
    assert said in problems(src, out)


def test_a_model_key_outside_the_quantization_config_is_caught(tmp_path: Path) -> None:
    src, out = convert(tmp_path, llama)
    edit(out / "config.json", lambda c: c.update(rope_theta=1.0))
    assert "config.json: differs from SOURCE's: rope_theta is 1.0" in problems(src, out)


def test_shard_metadata_is_checked(tmp_path: Path, rewrite_header: Callable[..., None]) -> None:
    """Extra `__metadata__` keys, or an `fp8fix_encoding` that is not the weights' encoding, were never read."""
    src, out = convert(tmp_path, llama, "--to", "e4m3fnuz")
    shard = sorted(out.glob("*.safetensors"))[0]
    rewrite_header(shard, lambda h: h["__metadata__"].update(fp8fix_encoding="e4m3fn"))
    assert "__metadata__ differs" in problems(src, out)
    rewrite_header(shard, lambda h: h["__metadata__"].update(fp8fix_encoding="e4m3fnuz", note="added"))
    assert "__metadata__ differs from SOURCE's and the encoding's in note" in problems(src, out)


def test_index_keys_are_checked(tmp_path: Path) -> None:
    src, out = convert(tmp_path, llama)
    edit(out / INDEX, lambda i: i.update(extra={"a": 1}))
    assert f"{INDEX}: keys ['extra'] differ from SOURCE's" in problems(src, out)
    edit(out / INDEX, lambda i: (i.pop("extra"), i["metadata"].update(note="x")))
    assert "metadata differs from SOURCE's beyond total_size" in problems(src, out)
