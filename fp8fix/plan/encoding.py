"""Planning an e4m3fn <-> e4m3fnuz conversion on top of a layout plan.

fn -> fnuz (AMD MI300): every FP8 weight keeps its bits (0x80, -0, becomes 0x00) and is
labelled F8_E4M3FNUZ; every scale that multiplies those codes doubles: weight scales
(per tensor, per shard, per channel) and static input scales. kv-cache scales stay:
runtimes double them themselves on fnuz platforms. Where the layout requantizes a
fused module, the codes are normalized FIRST and requantized in the fnuz domain (the
reverse order clips every weight above code 224).

fnuz -> fn: scales halve and bits stay, which is exact unless a tensor holds +-240
(0x7F/0xFF, NaN in fn). Such a tensor keeps its scale instead and each code becomes the
fn code of the same value: exact except codes below 2^-6 with an odd mantissa, which
round by half an fn step; the count is reported.
"""

from __future__ import annotations

from dataclasses import replace

from fp8fix.errors import UnsupportedCheckpoint
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.io.source_files import file_contains
from fp8fix.model import CheckpointModel
from fp8fix.numerics.dtypes import ENCODINGS, FP8_WEIGHT_DTYPES
from fp8fix.numerics.recodings import FN_TO_FNUZ, FNUZ_TO_FN, FNUZ_TO_FN_SAME_SCALE, Recoding
from fp8fix.plan.pieces import (
    CopyRange,
    EncodingChange,
    Fill,
    OutputShard,
    PadRows,
    Piece,
    Recode,
    RepeatRange,
    Requantize,
    RequantizeBlocks,
    Rescale,
    Ue8m0Codes,
    Ue8m0Scales,
)
from fp8fix.vocab import Encoding


def plan_encoding(model: CheckpointModel, shards: list[OutputShard], target: Encoding) -> EncodingChange | None:
    """Rewrite `shards` in place for the `target` encoding; None when the weights already use it.

    Planning an fnuz -> fn change reads weights, not only headers: a tensor holding +-240
    (NaN in e4m3fn) must keep its scale, and only a scan of its codes can tell.
    """
    fmt = model.require_format()
    written = {t.source for shard in shards for t in shard.tensors if t.dtype in FP8_WEIGHT_DTYPES}
    # the FP8 weights OUTPUT keeps in FP8 (not those `--tp-bf16` writes in BF16)
    fp8 = {
        w.name: w.tensor for w in model.weights.values() if w.tensor.dtype in FP8_WEIGHT_DTYPES and w.name in written
    }
    encodings = sorted({t.dtype for t in fp8.values()})
    if len(encodings) > 1:
        raise UnsupportedCheckpoint(
            f"the checkpoint mixes FP8 encodings ({', '.join(encodings)}); convert one at a time"
        )
    if not encodings:
        return None
    source, wanted = encodings[0], ENCODINGS[target]
    if source == wanted:
        return None
    activation_factor = FN_TO_FNUZ.scale_factor if wanted == FN_TO_FNUZ.target else FNUZ_TO_FN.scale_factor
    recodings: dict[str, Recoding] = {name: _recoding_for(t) for name, t in fp8.items()}
    factors: dict[str, float] = {}
    for name, recoding in recodings.items():
        factors[fmt.weight_scale_of(name)] = recoding.scale_factor
        if fmt.input_scale_of(name) in model.checkpoint.tensors:
            factors[fmt.input_scale_of(name)] = activation_factor
    for shard in shards:
        shard.metadata["fp8fix_encoding"] = target
        for t in shard.tensors:
            if t.source in recodings:
                t.dtype = wanted
                t.pieces = [_recoded(p, recodings[t.source], t.source) for p in t.pieces]
            elif t.source in factors:
                t.pieces = [_rescaled(p, t.dtype, factors[t.source], t.name) for p in t.pieces]
    return EncodingChange(
        source=FP8_WEIGHT_DTYPES[source],
        target=target,
        weights=len(fp8),
        scales=len(factors),
        kv_scales_kept=len(model.kv_cache_scales),
        same_scale_weights=sorted(n for n, r in recodings.items() if r is FNUZ_TO_FN_SAME_SCALE),
    )


def _recoding_for(t: TensorInfo) -> Recoding:
    if t.dtype == FN_TO_FNUZ.source:
        return FN_TO_FNUZ
    holds_240 = file_contains(t.path, t.start, t.end, (0x7F, 0xFF))
    return FNUZ_TO_FN_SAME_SCALE if holds_240 else FNUZ_TO_FN


def _recoded(piece: Piece, recoding: Recoding, name: str) -> Piece:
    if isinstance(piece, Ue8m0Codes) and recoding is FN_TO_FNUZ:  # power-of-two scales first, then relabel
        return replace(piece, recoding=recoding.name)
    if isinstance(piece, Fill):  # the zero codes of padded rows: 0x00 in either encoding
        return piece
    if isinstance(piece, PadRows):  # the rows recoded, the zero codes of the padded columns as they are
        return replace(piece, recoding=recoding.name)
    if isinstance(piece, CopyRange):
        return Recode(piece.path, piece.start, piece.end, recoding.name)
    if isinstance(piece, Requantize) and recoding is FN_TO_FNUZ:
        # normalize first, then requantize in the fnuz domain at the doubled scales
        f = recoding.scale_factor
        return Requantize(
            piece.path,
            piece.start,
            piece.end,
            recoding.target,
            piece.scale * f,
            piece.target_scale * f,
            recoding.target,
            normalize=recoding.name,
        )
    if isinstance(piece, Requantize):
        f = recoding.scale_factor
        return Requantize(
            piece.path, piece.start, piece.end, piece.dtype, piece.scale, piece.target_scale * f, recoding.target
        )
    if isinstance(piece, RequantizeBlocks):  # the same two orders as Requantize, column block by column block
        f = recoding.scale_factor
        targets = tuple(t * f for t in piece.targets)
        if recoding is FN_TO_FNUZ:
            scales = tuple(s * f for s in piece.scales)
            return replace(
                piece,
                dtype=recoding.target,
                scales=scales,
                targets=targets,
                out_dtype=recoding.target,
                normalize=recoding.name,
            )
        return replace(piece, targets=targets, out_dtype=recoding.target)
    raise AssertionError(f"{name}: cannot change the encoding of {piece}")


def _rescaled(piece: Piece, dtype: str, factor: float, name: str) -> Piece:
    if isinstance(piece, Ue8m0Scales):  # a power of two times 2: still one (its E8M0 exponent + 1)
        return replace(piece, factor=piece.factor * factor)
    if isinstance(piece, Fill):  # the scales of padded blocks multiply zero codes: any positive value does
        return piece
    if isinstance(piece, PadRows):
        return replace(piece, rescale=(dtype, factor))
    if isinstance(piece, CopyRange):
        return Rescale(piece.path, piece.start, piece.end, dtype, factor)
    if isinstance(piece, RepeatRange):
        return Rescale(piece.path, piece.start, piece.end, dtype, factor, piece.times)
    raise AssertionError(f"{name}: cannot rescale {piece}")
