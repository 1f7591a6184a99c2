"""The checkpoint a plan writes, described before it is written.

The writer lays out exactly these headers (verify checks it), so whatever depends only
on headers and config (the loaders' verdicts) is known for the output at planning
time: `--dry-run` prints the same verdicts a real run does.
"""

from __future__ import annotations

import math
from typing import Any

from fp8fix.io.checkpoint import CONFIG, Checkpoint
from fp8fix.io.safetensors_file import SafetensorsHeader, TensorInfo
from fp8fix.io.source_files import SourceFiles
from fp8fix.model import CheckpointModel, describe_checkpoint
from fp8fix.numerics.dtypes import INPUT_SCALE_DTYPES, decode_floats
from fp8fix.numerics.mx_blocks import reblock_rows
from fp8fix.plan.pieces import ConversionPlan, CopyRange, Fill, MxBlockScales, OutputTensor, RepeatRange, Rescale

#: The most values `planned_values` decodes for one tensor: scales per tensor or per shard, not grids.
MAX_PLANNED_VALUES = 64


def output_model(plan: ConversionPlan, model: CheckpointModel) -> CheckpointModel:
    """OUTPUT described as SOURCE is (`describe_checkpoint`), from the plan's headers and its config.json:
    what its loader verdicts (and `inspect --tp`'s shares) are worked out on."""
    config = plan.config_files.get(CONFIG, (model.checkpoint.config, []))[0]
    return describe_checkpoint(planned_checkpoint(plan, model.checkpoint, config), model.registry)


def planned_checkpoint(plan: ConversionPlan, source: Checkpoint, config: dict[str, Any]) -> Checkpoint:
    """OUTPUT as headers only (no data) with its `config`, in the source's folder for its side files; the
    values of its small scales come from the source bytes the plan makes them of (`planned_values`)."""
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
    planned = {t.name: t for shard in plan.shards for t in shard.tensors}
    codes = source.has_data and source.codes_on_disk
    return Checkpoint(
        source.root,
        config,
        source.index,
        shards,
        tensors,
        has_data=False,
        planned_values=lambda name: planned_values(planned[name], codes) if name in planned else None,
    )


def planned_values(tensor: OutputTensor, codes: bool = False) -> list[float] | None:
    """The values of a small float tensor OUTPUT will hold (a weight scale), from the source bytes its pieces
    copy, repeat or rescale, or (`codes`: the weights' codes are on disk) the powers of two a few re-blocked
    MXFP8 block rows get; None for any other piece or a bigger tensor."""
    count = math.prod(tensor.shape)
    if count > MAX_PLANNED_VALUES or tensor.dtype not in INPUT_SCALE_DTYPES:  # plain floats
        return None
    values: list[float] = []
    with SourceFiles() as files:
        for piece in tensor.pieces:
            if isinstance(piece, Fill):
                values += decode_floats(piece.value, tensor.dtype) * piece.times
            elif isinstance(piece, Rescale):
                read = decode_floats(files.read(piece.path, piece.start, piece.end), piece.dtype)
                values += [v * piece.factor for v in read] * piece.times
            elif isinstance(piece, RepeatRange):
                values += decode_floats(files.read(piece.path, piece.start, piece.end), tensor.dtype) * piece.times
            elif type(piece) is CopyRange:
                values += decode_floats(files.read(piece.path, piece.start, piece.end), tensor.dtype)
            elif isinstance(piece, MxBlockScales) and codes:  # a small grid (a few blocks): its rows re-blocked
                for row in piece.rows:
                    data, ref = files.read(row.path, row.start, row.end), row.scales
                    exponents = reblock_rows(data, files.read(ref.path, ref.start, ref.start + ref.count), row.cols)
                    values += [2.0**e for e in exponents.exponents]
            else:
                return None
    return values if len(values) == count else None
