"""The conversion plan as data: every output file and tensor, and where each tensor's bytes come from.

Planning reads safetensors headers, config.json, the few bytes of the scales and,
for an e4m3fnuz -> e4m3fn change, scans the weights for +-240. The result is
complete before a byte is written, so `--dry-run` can print it and the writer can
lay out each header up front, then stream tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8fix.io.safetensors_file import TensorInfo
from fp8fix.numerics.dtypes import ITEM_SIZE, tensor_nbytes
from fp8fix.numerics.mx import MX_BLOCK
from fp8fix.registry.formats import FormatSpec
from fp8fix.verdicts import LoaderVerdict
from fp8fix.vocab import Action, Encoding, Layout, OutputFormat, ScaleKind, Target


@dataclass(frozen=True)
class SourceRange:
    """The byte range [start, end) of a source file that an output piece is made from."""

    path: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes the piece writes."""
        return self.end - self.start


@dataclass(frozen=True)
class CopyRange(SourceRange):
    """Bytes copied unchanged from the source. `nan_check` names the FP8 dtype whose NaN
    codes must be refused: set for the untouched shard of a weight whose other shards
    are requantized, so a module is refused or converted as a whole."""

    nan_check: str | None = None


@dataclass(frozen=True)
class RepeatRange(SourceRange):
    """One source scalar's bytes written `times` times: a single scale spread over shards."""

    times: int

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * self.times


@dataclass(frozen=True)
class Requantize(SourceRange):
    """FP8 codes re-expressed at `target_scale`: dequantize in float32, divide, clamp, round to nearest even.

    `normalize` names a recoding applied to the bytes first (fn->fnuz): the codes are
    then read as `dtype` at `scale`, both already in the new encoding's terms.
    """

    dtype: str
    scale: float
    target_scale: float
    out_dtype: str
    normalize: str | None = None


@dataclass(frozen=True)
class RequantizeBlocks(SourceRange):
    """Whole rows of block-scaled FP8 codes re-expressed block by block, as `Requantize` does: each row
    (`row_bytes` codes) is cut into column blocks of `block_cols` codes, block c moving from `scales[c]`
    to `targets[c]` (blocks whose two scales are equal keep their codes). For rows that join an output
    block with rows of another source block (a split whose shard boundaries are not block multiples)."""

    dtype: str
    row_bytes: int
    block_cols: int
    scales: tuple[float, ...]
    targets: tuple[float, ...]
    out_dtype: str
    normalize: str | None = None


@dataclass(frozen=True)
class Recode(SourceRange):
    """FP8 codes mapped byte by byte to another encoding (see `numerics.recodings.RECODINGS`)."""

    recoding: str


@dataclass(frozen=True)
class Rescale(SourceRange):
    """Float scales multiplied by a power of two (exact), the result written `times` times."""

    dtype: str
    factor: float
    times: int = 1

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * self.times


@dataclass(frozen=True)
class PadRows(SourceRange):
    """Whole rows of `row_bytes` copied from the source, each followed by `pad` (zero codes, or scale
    values): the columns `--tp` adds to a down projection and its block scales. `recoding` maps the row
    bytes (fn <-> fnuz) and `rescale` multiplies them ((dtype, factor): scales), as Recode / Rescale do;
    the pad is written as it is."""

    row_bytes: int
    pad: bytes
    recoding: str | None = None
    rescale: tuple[str, float] | None = None

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) // self.row_bytes * (self.row_bytes + len(self.pad))


@dataclass(frozen=True)
class ScaleRef:
    """`count` consecutive values of a source scale tensor, from byte `start` of `path`: read when the
    piece is written, so planning reads no data (a Hub source plans from its headers)."""

    path: Path
    start: int
    count: int
    dtype: str
    name: str  # the scale tensor, for messages


@dataclass(frozen=True)
class Dequantize(SourceRange):
    """Whole rows of FP8 codes (`row_bytes` each) written as BF16 or F16 (`out_dtype`): the code at (r, c)
    times `col_scales[c // block_cols]` times `row_scales[r]` (an absent one is 1), rounded once to nearest
    even (`numerics.dequantize`). Per-tensor and per-shard scales are one column scale over every column;
    block scales a row of the grid; per-channel scales row scales. For `--to bf16`, `--dequantize` and
    `--tp-bf16`."""

    dtype: str
    row_bytes: int
    block_cols: int
    col_scales: ScaleRef | None
    row_scales: ScaleRef | None = None
    out_dtype: str = "BF16"

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * 2


@dataclass(frozen=True)
class MxDequantize(SourceRange):
    """Whole rows of MX element codes (`cols` elements each) written as BF16 or F16 (`out_dtype`): each element
    code x 2^(b - 127), b the E8M0 byte of its block of 32 in `scales` (one per block, the rows' in order).
    BF16 holds every such value exactly (`numerics.mx`); F16 rounds once. For `--to bf16` of an MX checkpoint."""

    element: str  # e4m3 (MXFP8) or e2m1 (MXFP4, two a byte)
    cols: int
    scales: ScaleRef
    out_dtype: str = "BF16"
    #: Rows of one stacked expert, each expert written transposed ([in, out]: gpt-oss's unquantized layout); 0:
    #: the rows as they are
    transposed_rows: int = 0

    @property
    def nbytes(self) -> int:
        return self.scales.count * 32 * 2

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's codes: one per e4m3 element, one per two E2M1 elements."""
        return self.cols if self.element == "e4m3" else self.cols // 2


@dataclass(frozen=True)
class Nvfp4Dequantize(SourceRange):
    """Whole rows of packed NVFP4 (`cols` E2M1 elements each) written as BF16 or F16 (`out_dtype`): each element
    times its group of 16's e4m3 scale (`scales`, the rows' own, in order) divided by `global_scale` (one F32),
    rounded once (`numerics.nvfp4`). For `--to bf16` of an NVFP4 module."""

    cols: int
    scales: ScaleRef
    global_scale: ScaleRef
    out_dtype: str = "BF16"
    multiply: bool = False  # ModelOpt's `weight_scale_2` multiplies the scales (compressed-tensors' divides them)

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * 2 * 2


@dataclass(frozen=True)
class Nvfp4Shared(SourceRange):
    """Rows of packed NVFP4 (`cols` elements each) and their e4m3fn scale bytes (`scales`, the rows' own),
    moved to the global scale their packed layer shares (`numerics.nvfp4_shared`, `ratio` their multiplier over
    the shared one, `multiplier`): `part` "packed" writes the new packed bytes, "scales" the new scale bytes."""

    cols: int
    scales: ScaleRef
    ratio: float
    multiplier: float
    weight: str  # the packed weight, for statistics and messages
    part: str = "packed"
    first_row: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start if self.part == "packed" else self.scales.count


@dataclass(frozen=True)
class MxBlockCodes(SourceRange):
    """Up to 128 rows of MXFP8 codes (`cols` each; MXFP4: packed elements) and their E8M0 bytes (`scales`: the rows'
    own, in order), written as e4m3fn codes at one power of two per 128 x 128 block (`numerics.mx_blocks`):
    `--blocks 128x128`."""

    cols: int
    scales: ScaleRef
    weight: str  # the weight written, for statistics and messages
    element: str = "e4m3"  # or e2m1: packed MXFP4 (two a byte), made e4m3fn codes first (exact)

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * (2 if self.element == "e2m1" else 1)


@dataclass(frozen=True)
class MxBlockScales:
    """A block-scale grid written as the powers of two its weight's block rows got (`MxBlockCodes`, in order),
    as F32."""

    rows: tuple[MxBlockCodes, ...]
    dtype: str = "F32"

    @property
    def nbytes(self) -> int:
        return sum(-(-r.cols // 128) for r in self.rows) * ITEM_SIZE[self.dtype]


@dataclass(frozen=True)
class Ue8m0Codes(SourceRange):
    """Rows of one block row of e4m3fn codes (`row_bytes` each), column block c at `col_scales[c]`, written
    at power-of-two scales (`numerics.ue8m0`: kept where the scale is one, else requantized once); then
    mapped by `recoding` (fn -> fnuz) where the encoding changes too. For `--scales ue8m0`."""

    dtype: str
    row_bytes: int
    block_cols: int
    col_scales: ScaleRef
    weight: str  # the source weight, for statistics and messages
    recoding: str | None = None
    vllm: bool = True  # vLLM's load-time requantization worked out beside (`--scales ue8m0`'s figures)


@dataclass(frozen=True)
class Ue8m0Scales:
    """A block-scale tensor written as the powers of two its weight's rows get (`Ue8m0Codes`, one per grid
    row, in order), in `dtype`, times `factor` (2 where the encoding becomes e4m3fnuz)."""

    rows: tuple[Ue8m0Codes, ...]
    dtype: str
    factor: float = 1.0

    @property
    def nbytes(self) -> int:
        return sum(len(range(0, r.row_bytes, r.block_cols)) for r in self.rows) * ITEM_SIZE[self.dtype]


@dataclass(frozen=True)
class MxScales:
    """MXFP8 scales written from the powers of two its weight's block rows get (`Ue8m0Codes`, in order): per row,
    the E8M0 byte of each 32 elements' block (k + 127 for 2^k), U8 [rows, cols / 32]. For `--blocks mx`."""

    rows: tuple[Ue8m0Codes, ...]

    @property
    def nbytes(self) -> int:
        return sum((r.end - r.start) // MX_BLOCK for r in self.rows)


@dataclass(frozen=True)
class Fill:
    """`value` written `times` times, from no source: zero codes of rows `--tp` adds, or their scales."""

    value: bytes
    times: int

    @property
    def nbytes(self) -> int:
        return len(self.value) * self.times


Piece = (
    CopyRange
    | RepeatRange
    | Requantize
    | RequantizeBlocks
    | Recode
    | Rescale
    | PadRows
    | Fill
    | Dequantize
    | MxDequantize
    | Nvfp4Dequantize
    | MxBlockCodes
    | MxBlockScales
    | Ue8m0Codes
    | Ue8m0Scales
    | MxScales
    | Nvfp4Shared
)


@dataclass
class OutputTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]
    source: str  # the source tensor it is made from
    reshaped: bool = False  # same bytes under another shape (compressed-tensors' [1] for a per-tensor scale)

    def __post_init__(self) -> None:
        expected = tensor_nbytes(self.dtype, self.shape)
        got = self.pieces[0].nbytes if len(self.pieces) == 1 else sum(p.nbytes for p in self.pieces)
        assert expected == got, f"{self.name}: planned {got} bytes for {self.dtype} {self.shape} ({expected})"

    @classmethod
    def copy_of(cls, t: TensorInfo) -> OutputTensor:
        """Source tensor `t` written as it is: its own bytes, which span its dtype and shape by the header
        checks (`io/safetensors_file.py`), so unchecked here: a 100k-tensor checkpoint is mostly these."""
        out = cls.__new__(cls)
        out.name, out.dtype, out.shape, out.source, out.reshaped = t.name, t.dtype, t.shape, t.name, False
        out.pieces = [CopyRange(t.path, t.start, t.end)]
        return out

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def unchanged(self) -> bool:
        """True when the tensor is the source tensor, same name, same bytes."""
        return (
            self.name == self.source
            and not self.reshaped
            and len(self.pieces) == 1
            and isinstance(self.pieces[0], CopyRange)
            and self.pieces[0].nan_check is None
        )


@dataclass
class OutputShard:
    name: str
    metadata: dict[str, str]
    tensors: list[OutputTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ModuleChange:
    """What happens to one fused module, and why, for the plan, the report and the model card."""

    module: str
    weight: str  # the source weight tensor (the writer's statistics are keyed by it)
    fused_module: str  # the registry's fused module suffix, e.g. self_attn.qkv_proj, or experts.gate_up_proj
    quantized: bool
    scale: ScaleKind
    action: Action
    reason: str
    shards: list[str]
    rows: list[int]  # of each shard: rows, or columns for stacked experts
    new_modules: list[str] = field(default_factory=list)
    blocks: int = 0  # block-scaled splits: output blocks, and those that mix source blocks (requantized)
    blocks_requantized: int = 0
    max_error: float | None = None  # filled in by convert from the writer's statistics (requantized modules)
    max_error_steps: float | None = None


@dataclass
class EncodingChange:
    """An e4m3fn <-> e4m3fnuz conversion: what it touches, and (after writing) what it could not keep exact."""

    source: Encoding
    target: Encoding
    weights: int
    scales: int
    kv_scales_kept: int
    same_scale_weights: list[str] = field(default_factory=list)  # fnuz -> fn tensors holding +-240
    inexact_codes: int | None = None  # filled in by convert from the writer's statistics


@dataclass
class ConversionPlan:
    source: Path
    architecture: str
    format: FormatSpec
    layout: Layout
    layout_was_default: bool  # True: chosen for `target`, not given with --layout
    modules: list[ModuleChange]
    shards: list[OutputShard]
    renames: dict[str, list[str]]  # fused module path -> per-shard module paths (unfused layout)
    has_index: bool
    encoding: EncodingChange | None = None
    padding: Any = None  # plan.padding.TpPadding with --tp: the MLPs padded and config sizes changed
    sources: dict[str, TensorInfo] = field(default_factory=dict)  # the source's tensors, for messages
    target: Target = "auto"
    output_format: OutputFormat = "keep"
    config_files: dict[str, tuple[dict[str, Any], list[str]]] = field(default_factory=dict)  # rewritten configs
    loaders: dict[str, LoaderVerdict] = field(default_factory=dict)  # verdicts on the output, by loader
    source_loaders: dict[str, LoaderVerdict] = field(default_factory=dict)  # the same on the source
    notes: list[str] = field(default_factory=list)  # what the user should know of the plan (printed as note:)
    dequantized: list[Any] = field(default_factory=list)  # plan.dequantized.Bf16Module: `--to bf16`, `--dequantize`
    unquantized: str | None = None  # `--to bf16` / `float16`: the whole model's dtype, written unquantized
    dropped_files: list[str] = field(default_factory=list)  # SOURCE files OUTPUT leaves out (a plain model's)
    ue8m0: Any = None  # plan.ue8m0.Ue8m0Change with `--scales ue8m0`
    reblocked: list[Any] = field(default_factory=list)  # plan.mx_blocks.ReblockedModule: `--blocks 128x128`
    shared_fp4: list[Any] = field(default_factory=list)  # plan.fp4_shared.SharedModule: NVFP4 at a layer's scale
    sketch: bool = False  # a `--target` candidate whose shards were not planned (`planner.plan_conversion`)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)
