"""FP8 checkpoint formats: how to recognise each from config.json and what it names how.

A format decides the scale shape convention (`[]` or `[1]` for one scale per tensor)
and where quantization_config lists module names that must follow a rename. Formats
fp8fix cannot convert yet are recognised too, so the user gets "not supported yet,
format X" instead of a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8fix.errors import InvalidCheckpoint, UnsupportedCheckpoint


@dataclass(frozen=True)
class FormatSpec:
    name: str  # quant_method as written in config.json
    label: str  # what people call it
    scalar_shape: tuple[int, ...]  # shape of a per-tensor scale written by this format
    name_lists: tuple[str, ...]  # quantization_config paths holding module names ('*' = every key)
    weight_scale: str = "weight_scale"
    input_scale: str = "input_scale"


AUTOFP8 = FormatSpec(
    name="fp8",
    label="AutoFP8 / vLLM fp8 (per-tensor)",
    scalar_shape=(),
    name_lists=("ignored_layers", "modules_to_not_convert"),
)

COMPRESSED_TENSORS = FormatSpec(
    name="compressed-tensors",
    label="compressed-tensors float-quantized",
    scalar_shape=(1,),
    name_lists=("ignore", "config_groups.*.targets"),
)

_NOT_YET = {
    "quark": "AMD Quark",
    "modelopt": "NVIDIA ModelOpt",
    "fbgemm_fp8": "FBGEMM FP8",
}


def _not_yet(label: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(
        f"config.json: {label} checkpoints are not supported yet; fp8fix converts AutoFP8 per-tensor "
        "and compressed-tensors tensor/channel FP8 checkpoints"
    )


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    qc = config.get("quantization_config") or config.get("compression_config")
    return qc if isinstance(qc, dict) else None


def detect_format(config: dict[str, Any], root: Path) -> FormatSpec:
    """The format of the checkpoint in `root`, or an error naming the unsupported one."""
    if (root / "hf_quant_config.json").exists():
        raise _not_yet("NVIDIA ModelOpt (hf_quant_config.json)")
    qc = quantization_config(config)
    if qc is None:
        raise InvalidCheckpoint(
            "config.json: has no quantization_config; fp8fix needs it to know how the FP8 weights were exported"
        )
    method = qc.get("quant_method")
    if method in _NOT_YET:
        raise _not_yet(_NOT_YET[method])
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise _not_yet(f"block FP8 (weight_block_size {qc['weight_block_size']})")
        return AUTOFP8
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return COMPRESSED_TENSORS
    raise UnsupportedCheckpoint(f"config.json: quant_method {method!r} is not an FP8 format fp8fix knows")


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _not_yet(f"compressed-tensors format {fmt!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise InvalidCheckpoint("config.json: compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _not_yet(
                f"compressed-tensors group {name} with {weights.get('num_bits')}-bit {weights.get('type')} weights"
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel"):
            raise _not_yet(f"compressed-tensors weight strategy {strategy!r} (group {name})")
