"""The checkpoint a plan writes, described before it is written.

The writer lays out exactly these headers (verify checks it), so whatever depends only
on headers and config (the loaders' verdicts) is known for the output at planning
time: `--dry-run` prints the same verdicts a real run does.
"""

from __future__ import annotations

from typing import Any

from fp8fix.io.checkpoint import Checkpoint
from fp8fix.io.safetensors_file import SafetensorsHeader, TensorInfo
from fp8fix.plan.pieces import ConversionPlan


def planned_checkpoint(plan: ConversionPlan, source: Checkpoint, config: dict[str, Any]) -> Checkpoint:
    """OUTPUT as headers only (no data) with its `config`, in the source's folder for its side files."""
    shards: dict[str, SafetensorsHeader] = {}
    tensors: dict[str, TensorInfo] = {}
    for shard in plan.shards:
        path = source.root / shard.name
        infos: dict[str, TensorInfo] = {}
        offset = 0
        for t in shard.tensors:
            infos[t.name] = TensorInfo(t.name, path, t.dtype, t.shape, offset, offset + t.nbytes)
            offset += t.nbytes
        shards[shard.name] = SafetensorsHeader(path, shard.metadata, infos)
        tensors.update(infos)
    return Checkpoint(source.root, config, source.index, shards, tensors, has_data=False)
