"""The state one verification shares across its checks, instead of threading it through parameters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fp8fix.errors import InvalidCheckpoint
from fp8fix.io.checkpoint import Checkpoint, check_scale_values
from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.io.source_files import SourceFiles
from fp8fix.model import CheckpointModel, FusedModule
from fp8fix.numerics.dtypes import FP8_WEIGHT_DTYPES, ITEM_SIZE, is_fp8
from fp8fix.registry.formats import COMPRESSED_TENSORS, FormatSpec, quantization_config
from fp8fix.verification.report import VerifyReport, WeightCheck

#: Elements compared per step: memory stays at a few row chunks whatever the tensor's size.
CHUNK_ELEMENTS = 1024 * 1024


class Mismatch(Exception):
    """OUTPUT is not what SOURCE makes it; the message names the tensor. Caught per tensor into its record
    (`WeightCheck.mismatched`) or the report. `codes`: how many codes (values) of the rows compared differ,
    for a difference in values (0: what does not fit is not a value: a shape, a scale, a missing tensor), the
    message describing the largest of them."""

    def __init__(self, text: str, codes: int = 0) -> None:
        super().__init__(text)
        self.codes = codes


@contextmanager
def counting(check: WeightCheck) -> Iterator[None]:
    """Different values in one run of rows go into the weight's record and its check goes on with the next run,
    so the record counts every differing code; any other mismatch ends the weight's check."""
    try:
        yield
    except Mismatch as e:
        if not e.codes:
            raise
        check.mismatched(str(e), e.codes)


@dataclass
class VerifyContext:
    model: CheckpointModel  # SOURCE, described as convert describes it
    out: Checkpoint  # OUTPUT, read as files only: nothing about it is taken from the plan
    fmt: FormatSpec
    report: VerifyReport
    files: SourceFiles  # descriptors of both checkpoints' files
    padded: dict[str, Any] = field(default_factory=dict)  # `--tp`: SOURCE tensors OUTPUT holds padded (padding.py)
    dequantized: dict[str, Any] = field(default_factory=dict)  # `--tp-bf16`: FP8 weights OUTPUT holds in BF16
    dropped: set[str] = field(default_factory=set)  # their scales, which OUTPUT must not hold
    ue8m0: dict[str, Any] = field(default_factory=dict)  # `--scales ue8m0`: weights at power-of-two block scales
    reblocked: dict[str, Any] = field(default_factory=dict)  # `--blocks 128x128`: MXFP8 weights as block FP8
    block_mx: dict[str, Any] = field(default_factory=dict)  # `--blocks mx`: block FP8 weights as MXFP8
    fp4: dict[str, Any] = field(default_factory=dict)  # FP4 modules OUTPUT holds unquantized, by packed weight
    shared_fp4: dict[str, Any] = field(default_factory=dict)  # NVFP4 modules at their layer's shared global scale
    #: SOURCE tensors OUTPUT holds under another name: an FP4 module's packed weight as its `<module>.weight`
    renamed: dict[str, str] = field(default_factory=dict)
    source_name: str | None = None  # SOURCE as OUTPUT's card must name it (a Hub repo id, or the folder's name)

    @property
    def src(self) -> Checkpoint:
        return self.model.checkpoint

    def read_rows(self, t: TensorInfo, r0: int, r1: int, cols: int) -> bytes:
        """Rows [r0, r1) of `t` viewed as rows of `cols` elements."""
        item = ITEM_SIZE[t.dtype]
        return self.files.read(t.path, t.start + r0 * cols * item, t.start + r1 * cols * item)

    def shard_of_rows(self, module: str) -> list[int] | None:
        """The shard of each row of a fused module of SOURCE's registry entry, None for other modules."""
        f: FusedModule | None = self.model.fused.get(module)
        return f.shard_of_rows() if f else None


def fp8_weight_dtypes(ctx: VerifyContext, side: str) -> set[str]:
    """The FP8 encodings (safetensors dtypes) of SOURCE's or OUTPUT's tensors, but those OUTPUT made of FP4 modules
    (`renamed`): an FP4 module written as FP8 did not change encoding."""
    ckpt = ctx.src if side == "SOURCE" else ctx.out
    made = set(ctx.renamed.values()) if side == "OUTPUT" else set()
    return {t.dtype for t in ckpt.tensors.values() if t.dtype in FP8_WEIGHT_DTYPES and t.name not in made}


def plain_output(ctx: VerifyContext) -> bool:
    """OUTPUT is a plain model: no quantization config and no FP8 tensor (`convert --to bf16`)."""
    return quantization_config(ctx.out.config) is None and not any(is_fp8(t.dtype) for t in ctx.out.tensors.values())


def side_configs_dropped(ctx: VerifyContext) -> bool:
    """OUTPUT leaves SOURCE's side config (ModelOpt's hf_quant_config.json) behind: a plain model, or MX weights
    re-blocked under a compressed-tensors config (which a side config saying MXFP8 would contradict)."""
    method = (quantization_config(ctx.out.config) or {}).get("quant_method")
    converted = method == COMPRESSED_TENSORS.name and ctx.fmt.name != COMPRESSED_TENSORS.name
    return plain_output(ctx) or (bool(ctx.reblocked) and converted)


def scale_values(scale: TensorInfo, where: str) -> list[float]:
    """A scale's values; a value no weight can be recovered from is a mismatch naming SOURCE or OUTPUT."""
    try:
        return check_scale_values(scale)
    except InvalidCheckpoint as e:  # zero, negative, inf or NaN
        raise Mismatch(f"{where}: {e}") from e
