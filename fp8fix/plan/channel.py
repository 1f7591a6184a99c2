"""The channel layout: every FP8 weight's scale written per output row ([out, 1]), codes untouched.

A fused module whose shards carry different scales has no exact single scale: runtimes
requantize it to the largest at load (vLLM 0.32: 0.50-0.52 fp8 step off, through
float16), and so does `--layout fused` (up to half a step). One scale per row holds the
same weights exactly: each row keeps its own shard's scale and no code changes. vLLM
0.32 and transformers 5.x load compressed-tensors `strategy: channel` checkpoints with
fused names bit-exact (tests/loaders), while vLLM rejects `quant_method: fp8` with
per-row scales, so this layout is written as compressed-tensors. This module plans the
weights outside fused modules (their one scale repeated per row); fused modules are
planned with the other layouts in `fused.py`. Scales keep their dtype: repeated, never
recomputed, so never rounded.
"""

from __future__ import annotations

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.model import CheckpointModel
from fp8fix.plan.pieces import CopyRange, OutputTensor, Piece, RepeatRange


def channel_shape(rows: int) -> tuple[int, int]:
    """compressed-tensors' per-channel weight scale shape."""
    return (rows, 1)


def plan_channel_weights(model: CheckpointModel) -> dict[str, list[OutputTensor]]:
    """Per-row scales for every FP8 linear weight outside fused modules: a single scale repeated,
    a 1-D per-channel scale reshaped (same bytes)."""
    outputs: dict[str, list[OutputTensor]] = {}
    for w in model.module_weights():
        if w.stacked:
            raise UnsupportedCheckpoint(
                f"{w.tensor.path.name}: stacked experts '{w.name}': the channel layout has no per-row form for them; "
                "use --layout per-shard or --layout fused"
            )
        s, rows = w.scale, w.tensor.shape[0]
        if w.fused is not None or s is None or s.shape == channel_shape(rows):
            continue
        pieces: list[Piece]
        if w.scale_kind == "tensor":
            pieces = [RepeatRange(s.path, s.start, s.end, rows)]
        elif w.scale_kind == "channel":
            pieces = [CopyRange(s.path, s.start, s.end)]
        else:
            raise UnsupportedCheckpoint(
                f"{s.path.name}: '{s.name}' holds {w.scale_kind} scales, which one scale per row cannot hold "
                "without requantizing; the channel layout is for per-tensor and per-shard scales"
            )
        outputs[s.name] = [OutputTensor(s.name, s.dtype, channel_shape(rows), pieces, s.name)]
    return outputs
