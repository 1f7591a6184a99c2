"""`verify`: prove that OUTPUT is a faithful conversion of SOURCE, tensor by tensor.

The mapping from source to output tensors is worked out from names and the
architecture registry alone, not from the converter's plan, so a planner bug
cannot vouch for itself. Then:
- every FP8 weight is dequantized on both sides in float32, row chunk by row chunk:
  where the output scale is the source scale times a power of two (splits, fn <-> fnuz)
  every output code must be the source value at the output scale, exactly when that
  value exists in the output encoding and else its nearest-even rounding; elsewhere
  (requantized modules) within half an fp8 step, or at the clamp;
- static input scales equal the source's (times the encoding's factor, or their max);
- every other tensor, or its row slice, is byte-identical;
- index, shard files, config.json and the copied files are what they should be.
Memory stays at one row chunk per tensor whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8fix.checkpoint import CONFIG, INDEX, Checkpoint, check_scale_values, open_checkpoint
from fp8fix.config_edit import rewrite_name_lists
from fp8fix.dtypes import E4M3FN, E4M3FNUZ, FP8_WEIGHT_DTYPES, ITEM_SIZE, REQUANT_CLAMP
from fp8fix.errors import InvalidCheckpoint
from fp8fix.experts import is_stacked_experts
from fp8fix.model_card import CARD
from fp8fix.planner import FusedModule, find_fused_modules
from fp8fix.registry.architectures import ArchitectureSpec, known_architectures
from fp8fix.registry.formats import FormatSpec, detect_format
from fp8fix.safetensors_file import TensorInfo, read_values
from fp8fix.transforms import MANTISSA_BITS, MIN_NORMAL_EXPONENT, value_map
from fp8fix.writer import progress_bar

CHUNK_ELEMENTS = 1024 * 1024
MAX_PROBLEMS = 50


@dataclass
class Target:
    """Where rows [start, end) of a source tensor went: rows from `out_offset` of `name` in OUTPUT
    (for a per-tensor or per-shard scale: the whole tensor, entry `index` of the source)."""

    name: str
    start: int
    end: int
    index: int | None = None
    out_offset: int = 0


@dataclass
class WeightCheck:
    tensor: str
    targets: list[str]
    kind: str  # exact | rounded | requantized
    max_error: float = 0.0
    max_error_steps: float = 0.0
    rounded_codes: int = 0


@dataclass
class VerifyReport:
    source: str
    output: str
    weights: list[WeightCheck] = field(default_factory=list)
    identical_tensors: int = 0
    scales_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data

    def summary(self) -> str:
        kinds = {k: sum(w.kind == k for w in self.weights) for k in ("exact", "rounded", "requantized")}
        worst = max((w.max_error_steps for w in self.weights if w.kind == "requantized"), default=None)
        text = (
            f"{len(self.weights)} FP8 weights ({kinds['exact']} exact, {kinds['rounded']} with rounded codes, "
            f"{kinds['requantized']} requantized"
            + (f", max {worst:.2f} fp8 steps" if worst is not None else "")
            + f"), {self.scales_checked} input scales, {self.identical_tensors} tensors byte-identical"
        )
        return text


def verify(source: Path, output: Path, quiet: bool = False) -> VerifyReport:
    src, out = open_checkpoint(source), open_checkpoint(output)
    fmt = detect_format(src.config, src.root, set(src.tensors))
    arch = known_architectures().get((src.config.get("architectures") or [""])[0])
    fused = {m.path: m for m in find_fused_modules(src, arch)} if arch else {}
    report = VerifyReport(str(source), str(output))
    mapping = _map_tensors(src, out, fmt, fused, report)
    stacked = {n for n, t in src.tensors.items() if t.dtype in FP8_WEIGHT_DTYPES and is_stacked_experts(t, arch)}
    weights = {n for n, t in src.tensors.items() if t.dtype in FP8_WEIGHT_DTYPES and n.endswith(".weight")} | stacked
    scale_names = {fmt.weight_scale_of(w) for w in weights}
    input_of = {fmt.input_scale_of(w): w for w in weights if fmt.input_scale_of(w) in src.tensors}
    scales = scale_names | set(input_of)  # checked through the weights' values, not streamed
    total = sum(src.tensors[n].nbytes for n in mapping if n not in scales)
    fds: dict[Path, int] = {}
    try:
        with progress_bar(total, "fp8fix verify", quiet) as bar:
            for name, targets in mapping.items():
                if arch is not None and name in stacked:
                    report.weights.append(_check_stacked_experts(src, out, fmt, arch, name, fds, report))
                elif name in weights:
                    report.weights.append(_check_weight(src, out, fmt, fused, name, targets, fds, report))
                elif name in input_of:
                    _check_input_scale(src, out, name, input_of[name], targets, report)
                elif name not in scale_names:
                    _check_bytes(src, out, name, targets, fds, report)
                bar.update(0 if name in scales else src.tensors[name].nbytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    renames = {m: [tg.name.rsplit(".", 1)[0] for tg in targets] for m, targets in _module_renames(mapping, fused)}
    _check_repo(src, out, fmt, renames, report)
    return report


def _map_tensors(
    src: Checkpoint, out: Checkpoint, fmt: FormatSpec, fused: dict[str, FusedModule], report: VerifyReport
) -> dict[str, list[Target]]:
    """Each source tensor -> where it is in OUTPUT: the same name, or the per-shard names of its fused module."""
    mapping: dict[str, list[Target]] = {}
    for name, t in src.tensors.items():
        rows = t.shape[0] if t.shape else 1
        if name in out.tensors:
            mapping[name] = [Target(name, 0, rows)]
            continue
        module, _, param = name.rpartition(".")
        f = fused.get(module)
        if f is not None and f.spec.can_unfuse:
            names = [f"{f.spec.unfused_path(module, s)}.{param}" for s in f.spec.shards]
            if all(n in out.tensors for n in names):
                per_shard = t.shape == (len(f.rows),)
                targets: list[Target] = []
                for i, n in enumerate(names):
                    if t.numel == 1 or per_shard:
                        targets.append(Target(n, 0, rows, index=i))
                        continue
                    unit = fmt.block[0] if fmt.block and param == fmt.weight_scale and len(t.shape) == 2 else 1
                    offset = 0
                    for a, b in f.shard_segments(i):  # grouped modules: one segment per group
                        targets.append(Target(n, a // unit, -(-b // unit), out_offset=offset))
                        offset += -(-b // unit) - a // unit
                mapping[name] = targets
                continue
        report.problem(f"tensor '{name}' of SOURCE is missing from OUTPUT")
    claimed = {tg.name for targets in mapping.values() for tg in targets}
    for name in out.tensors:
        if name not in claimed:
            report.problem(f"OUTPUT has tensor '{name}', which nothing in SOURCE accounts for")
    return mapping


def _module_renames(mapping: dict[str, list[Target]], fused: dict[str, FusedModule]):  # type: ignore[no-untyped-def]
    for name, targets in mapping.items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module in fused and targets[0].name != name:
            yield module, targets


def _scale_rows(scale: TensorInfo | None, weight: TensorInfo, row_shards: list[int] | None, where: str) -> list[float]:
    """One scale value per row of `weight`, from a per-tensor, per-shard or per-channel scale."""
    if scale is None:
        raise _Mismatch(f"{where}: FP8 weight '{weight.name}' has no scale")
    values = _scale_values(scale, where)
    rows = weight.shape[0]
    if len(values) == 1:
        return values * rows
    if row_shards and len(values) == max(row_shards) + 1 and len(row_shards) == rows:
        return [values[shard] for shard in row_shards]
    if len(values) == rows:
        return values
    raise _Mismatch(f"{where}: scale '{scale.name}' of shape {list(scale.shape)} does not fit '{weight.name}'")


class _Mismatch(Exception):
    pass


def _scale_values(scale: TensorInfo, where: str) -> list[float]:
    try:
        return check_scale_values(scale)
    except InvalidCheckpoint as e:
        raise _Mismatch(f"{where}: {e}") from e


def _fd(fds: dict[Path, int], path: Path) -> int:
    if path not in fds:
        fds[path] = os.open(path, os.O_RDONLY)
    return fds[path]


def _check_weight(
    src: Checkpoint,
    out: Checkpoint,
    fmt: FormatSpec,
    fused: dict[str, FusedModule],
    name: str,
    targets: list[Target],
    fds: dict[Path, int],
    report: VerifyReport,
) -> WeightCheck:
    w = src.tensors[name]
    module = name.rsplit(".", 1)[0]
    check = WeightCheck(name, [t.name for t in targets], "exact")
    try:
        src_scale = src.tensors.get(fmt.weight_scale_of(name))
        if fmt.block and src_scale is not None and src_scale.numel > 1 and len(src_scale.shape) == 2:
            for target in targets:
                out_scale = out.tensors.get(f"{target.name.rsplit('.', 1)[0]}.{fmt.weight_scale}")
                _compare_block(w, out.tensors[target.name], target, src_scale, out_scale, fmt.block, fds, check)
            return check
        src_scales = _scale_rows(src_scale, w, _rows_of(fused, module), "SOURCE")
        for target in targets:
            o = out.tensors[target.name]
            if (
                o.dtype not in FP8_WEIGHT_DTYPES
                or o.shape[1:] != w.shape[1:]
                or o.shape[0] < target.out_offset + (target.end - target.start)
            ):
                raise _Mismatch(f"'{target.name}' is {o.dtype} {list(o.shape)}, expected FP8 rows of '{name}'")
            out_module = target.name.rsplit(".", 1)[0]
            out_scale = out.tensors.get(f"{out_module}.{fmt.weight_scale}")
            out_scales = _scale_rows(out_scale, o, _rows_of(fused, out_module), "OUTPUT")
            _compare_rows(w, o, target, src_scales, out_scales, fds, check)
    except _Mismatch as e:
        report.problem(str(e))
    return check


def _check_stacked_experts(
    src: Checkpoint,
    out: Checkpoint,
    fmt: FormatSpec,
    arch: ArchitectureSpec,
    name: str,
    fds: dict[Path, int],
    report: VerifyReport,
) -> WeightCheck:
    """Stacked experts [E, in, out]: same shape; every (expert, column) scale is the source's times one
    power of two (fp8fix never requantizes experts); codes are the source values at the new scales."""
    import torch

    w, o = src.tensors[name], out.tensors[name]
    check = WeightCheck(name, [name], "exact")
    try:
        if o.dtype not in FP8_WEIGHT_DTYPES or o.shape != w.shape:
            raise _Mismatch(f"'{name}' is {o.dtype} {list(o.shape)}, expected FP8 {list(w.shape)}")
        src_grid = _expert_column_scales(src, fmt, arch, w, "SOURCE")
        out_grid = _expert_column_scales(out, fmt, arch, w, "OUTPUT")
        ratios = torch.unique(out_grid / src_grid).tolist()
        if len(ratios) != 1 or not _power_of_two(ratios[0]):
            raise _Mismatch(
                f"'{fmt.weight_scale_of(name)}': the scales are not SOURCE's times one power of two "
                f"(ratios {ratios[:4]})"
            )
        experts, inner, cols = w.shape
        rows = experts * inner  # the tensor as [E * in, out] rows, expert e owning rows [e * in, (e + 1) * in)
        step_rows = max(1, CHUNK_ELEMENTS // cols)
        target = Target(name, 0, rows)
        for r0 in range(0, rows, step_rows):
            r1 = min(rows, r0 + step_rows)
            a, b = _read(fds, w, r0, r1, cols), _read(fds, o, r0, r1, cols)
            if not _same_values(a, b, w.dtype, o.dtype, ratios[0], name, r0, cols):
                experts_of_rows = torch.arange(r0, r1) // inner
                s_src, s_out = src_grid[experts_of_rows].float(), out_grid[experts_of_rows].float()
                _compare_values(w, o, target, r0, r1, a, b, s_src, s_out, check)
    except _Mismatch as e:
        report.problem(str(e))
    return check


def _expert_column_scales(ckpt: Checkpoint, fmt: FormatSpec, arch: ArchitectureSpec, w: TensorInfo, where: str) -> Any:
    """The scale of every (expert, output column) of stacked experts `w`, as a float64 [E, out] tensor."""
    import torch

    experts, _, cols = w.shape
    scale = ckpt.tensors.get(fmt.weight_scale_of(w.name))
    if scale is None:
        raise _Mismatch(f"{where}: FP8 experts '{w.name}' have no scale")
    values = torch.tensor(_scale_values(scale, where), dtype=torch.float64)
    if values.numel() == 1:
        return values.reshape(1, 1).expand(experts, cols)
    if values.numel() == experts:
        return values.reshape(experts, 1).expand(experts, cols)
    if values.numel() == experts * cols:
        return values.reshape(experts, cols)
    shards = arch.experts.fused.get(w.name.rpartition(".")[2], ()) if arch.experts else ()
    widths = [arch.size(s.rows, f"shard '{s.shard}'", ckpt.config) for s in shards]
    if widths and scale.shape == (experts, len(widths)) and sum(widths) == cols:
        return values.reshape(experts, -1).repeat_interleave(torch.tensor(widths), dim=1)
    raise _Mismatch(f"{where}: scale '{scale.name}' of shape {list(scale.shape)} does not fit '{w.name}'")


def _rows_of(fused: dict[str, FusedModule], module: str) -> list[int] | None:
    """The shard of each row of a fused module (storage order), None for other modules."""
    f = fused.get(module)
    return [shard for shard, a, b in f.segments for _ in range(b - a)] if f else None


def _compare_rows(
    w: TensorInfo,
    o: TensorInfo,
    target: Target,
    src_scales: list[float],
    out_scales: list[float],
    fds: dict[Path, int],
    check: WeightCheck,
) -> None:
    """Compare rows run by run, where a run shares one output/source scale ratio.

    A power-of-two ratio (splits, fn <-> fnuz) is checked as bytes: the output codes must
    be the source codes through `value_map`, the table of same-value codes. Runs that
    round or requantize are dequantized in float32 with torch.
    """
    cols = math.prod(w.shape[1:])
    top_scale = max(src_scales)
    row = target.start
    while row < target.end:
        ratio = out_scales[row - target.start + target.out_offset] / src_scales[row]
        end = row + 1
        while end < target.end and out_scales[end - target.start + target.out_offset] / src_scales[end] == ratio:
            end += 1
        out_row = row - target.start + target.out_offset
        if not _power_of_two(ratio) and not _power_of_two(out_scales[out_row] / top_scale):
            raise _Mismatch(
                f"'{o.name}' row {out_row}: scale {out_scales[out_row]:.6g} is neither the source's "
                f"({src_scales[row]:.6g}) nor the largest of its module ({top_scale:.6g}) times a power of two"
            )
        step_rows = max(1, CHUNK_ELEMENTS // max(cols, 1))
        for r0 in range(row, end, step_rows):
            r1 = min(end, r0 + step_rows)
            a, b = (
                _read(fds, w, r0, r1, cols),
                _read(fds, o, r0 - target.start + target.out_offset, r1 - target.start + target.out_offset, cols),
            )
            if _power_of_two(ratio) and _same_values(
                a, b, w.dtype, o.dtype, ratio, o.name, r0 - target.start + target.out_offset, cols
            ):
                continue
            _compare_values(w, o, target, r0, r1, a, b, src_scales, out_scales, check)
        row = end


def _same_values(a: bytes, b: bytes, src: str, out: str, ratio: float, name: str, row0: int, cols: int) -> bool:
    """True when `b` is exactly `a`'s values at the new scale; False when some codes round (check those
    with floats); raises on anything else."""
    expected, rounded, overflow = value_map(src, out, ratio)
    if any(bytes([c]) in a for c in overflow):
        raise _Mismatch(f"'{name}': source values beyond the range of {out} at the output scale (clipped)")
    if any(bytes([c]) in a for c in rounded):
        return False
    mapped = a.translate(expected)
    if mapped != b:
        first = next(i for i in range(len(b)) if mapped[i] != b[i])
        raise _Mismatch(
            f"'{name}' row {row0 + first // cols} column {first % cols}: code 0x{b[first]:02X}, expected "
            f"0x{mapped[first]:02X} (the source's value at the output scale)"
        )
    return True


def _compare_values(
    w: TensorInfo,
    o: TensorInfo,
    target: Target,
    r0: int,
    r1: int,
    a_bytes: bytes,
    b_bytes: bytes,
    src_scales: Any,
    out_scales: Any,
    check: WeightCheck,
) -> None:
    """Dequantize rows [r0, r1) in float32 and compare; scales are per-row lists or per-element tensors."""
    import torch

    fp8 = {E4M3FN: torch.float8_e4m3fn, E4M3FNUZ: torch.float8_e4m3fnuz}
    clamp = REQUANT_CLAMP[o.dtype]
    if isinstance(src_scales, list):
        s_src = torch.tensor(src_scales[r0:r1], dtype=torch.float32).reshape(-1, 1)
        first = r0 - target.start + target.out_offset
        s_out = torch.tensor(out_scales[first : first + (r1 - r0)], dtype=torch.float32).reshape(-1, 1)
    else:
        s_src, s_out = src_scales, out_scales
    a = torch.frombuffer(bytearray(a_bytes), dtype=torch.uint8).view(fp8[w.dtype]).float().reshape(r1 - r0, -1)
    b = torch.frombuffer(bytearray(b_bytes), dtype=torch.uint8).view(fp8[o.dtype]).float().reshape(r1 - r0, -1)
    src_value = a * s_src
    _, exponent_of_ratio = torch.frexp(s_out.double() / s_src.double())
    mantissa, _ = torch.frexp(s_out.double() / s_src.double())
    power_of_two = (mantissa == 0.5).expand_as(a)
    # the code at the output scale: exact (a power-of-two multiple of the source code) for splits and
    # encoding changes; for requantized rows the converter's own float32 formula, clamped before rounding
    # (to +-224 for e4m3fnuz, as vLLM's ROCm kernels do)
    q = torch.where(power_of_two, a * (s_src / s_out), src_value / s_out)
    clamped = q.clamp(-clamp, clamp)
    nearest = clamped.to(fp8[o.dtype]).float()
    _, exponent = torch.frexp(clamped)
    step = torch.exp2((exponent - 1).clamp(min=MIN_NORMAL_EXPONENT[o.dtype]).float() - MANTISSA_BITS)
    steps = (b - clamped).abs() / step
    both_nan = torch.isnan(b) & torch.isnan(q)  # a NaN moved as bytes stays the NaN it was
    ok = torch.where(power_of_two, (b == nearest) | both_nan, steps <= 0.5 + 1e-6)
    if not bool(ok.all()):
        row, col = (~ok).nonzero()[0].tolist()
        out_value = float((b * s_out)[row, col])
        out_row = r0 - target.start + target.out_offset + row
        raise _Mismatch(
            f"'{o.name}' (from '{w.name}') row {out_row} column {col}: source value "
            f"{float(src_value[row, col]):.6g}, output {out_value:.6g}"
        )
    error = torch.where(both_nan, 0.0, (b * s_out - src_value).abs())
    check.max_error = max(check.max_error, float(error.max()) if error.numel() else 0.0)
    if not bool(power_of_two.all()):
        check.kind = "requantized"
        check.max_error_steps = max(check.max_error_steps, float(steps[~power_of_two].max()))
    rounded = int(((nearest != q) & power_of_two & ~both_nan).sum())
    if rounded and check.kind == "exact":
        check.kind = "rounded"
    check.rounded_codes += rounded


def _compare_block(
    w: TensorInfo,
    o: TensorInfo,
    target: Target,
    src_scale: TensorInfo,
    out_scale: TensorInfo | None,
    block: tuple[int, int],
    fds: dict[Path, int],
    check: WeightCheck,
) -> None:
    """Block-scaled rows: the output's block scales must be the source's block rows times one power of two,
    and the codes the source values at those scales."""
    b0, b1 = block
    cols = math.prod(w.shape[1:])
    if out_scale is None:
        raise _Mismatch(f"'{o.name}' has no block scale")
    grid_cols = src_scale.shape[1]
    src_grid = _scale_values(src_scale, "SOURCE")
    out_grid = _scale_values(out_scale, "OUTPUT")
    first, last = target.start // b0, -(-target.end // b0)
    out_first = target.out_offset // b0
    expected = src_grid[first * grid_cols : last * grid_cols]
    got = out_grid[out_first * grid_cols : (out_first + last - first) * grid_cols]
    if (
        target.start % b0
        or target.out_offset % b0
        or len(got) != len(expected)
        or out_scale.shape[1:] != src_scale.shape[1:]
    ):
        raise _Mismatch(f"'{out_scale.name}' does not hold the block rows {first}..{last - 1} of '{src_scale.name}'")
    ratios = {o_ / s_ for o_, s_ in zip(got, expected, strict=True)}
    if len(ratios) != 1 or not _power_of_two(next(iter(ratios))):
        raise _Mismatch(f"'{out_scale.name}': block scales are not '{src_scale.name}' times one power of two")
    ratio = ratios.pop()
    step_rows = max(b0, (CHUNK_ELEMENTS // max(cols, 1)) // b0 * b0)
    for r0 in range(target.start, target.end, step_rows):
        r1 = min(target.end, r0 + step_rows)
        o0 = r0 - target.start + target.out_offset
        a, b = _read(fds, w, r0, r1, cols), _read(fds, o, o0, o0 + (r1 - r0), cols)
        if _same_values(a, b, w.dtype, o.dtype, ratio, o.name, o0, cols):
            continue
        s_src = _expand_grid(src_grid, grid_cols, r0, r1 - r0, cols, block)
        s_out = _expand_grid(out_grid, grid_cols, o0, r1 - r0, cols, block)
        _compare_values(w, o, target, r0, r1, a, b, s_src, s_out, check)


def _expand_grid(grid: list[float], grid_cols: int, row0: int, rows: int, cols: int, block: tuple[int, int]) -> Any:
    """One scale per element of rows [row0, row0 + rows) from a block grid."""
    import torch

    g = torch.tensor(grid, dtype=torch.float32).reshape(-1, grid_cols)
    return g[torch.arange(row0, row0 + rows) // block[0]][:, torch.arange(cols) // block[1]]


def _power_of_two(ratio: float) -> bool:
    return ratio > 0 and math.frexp(ratio)[0] == 0.5


def _read(fds: dict[Path, int], t: TensorInfo, r0: int, r1: int, cols: int) -> bytes:
    item = ITEM_SIZE[t.dtype]
    return os.pread(_fd(fds, t.path), (r1 - r0) * cols * item, t.start + r0 * cols * item)


def _encoding_factor(src: Checkpoint, out: Checkpoint, weight: str, out_weight: str) -> float:
    a, b = src.tensors[weight].dtype, out.tensors[out_weight].dtype
    return {(E4M3FN, E4M3FNUZ): 2.0, (E4M3FNUZ, E4M3FN): 0.5}.get((a, b), 1.0)


def _check_input_scale(
    src: Checkpoint, out: Checkpoint, name: str, weight: str, targets: list[Target], report: VerifyReport
) -> None:
    s = src.tensors[name]
    values = read_values(s)
    for target in targets:
        o = out.tensors[target.name]
        got = read_values(o)
        out_weight = target.name.rsplit(".", 1)[0] + ".weight" if weight.endswith(".weight") else weight
        f = _encoding_factor(src, out, weight, out_weight)
        if target.index is not None and len(values) > 1:
            expected = [[values[target.index] * f]]
        elif len(values) == 1:
            expected = [[values[0] * f] * len(got)]
        else:
            expected = [[v * f for v in values], [max(values) * f]]
        report.scales_checked += 1
        if o.dtype != s.dtype or got not in expected:
            report.problem(
                f"input scale '{target.name}' is {o.dtype} {got}; expected {s.dtype} "
                + " or ".join(map(str, expected))
                + f" from '{name}'"
            )


def _check_bytes(
    src: Checkpoint, out: Checkpoint, name: str, targets: list[Target], fds: dict[Path, int], report: VerifyReport
) -> None:
    t = src.tensors[name]
    row_bytes = t.nbytes // (t.shape[0] if t.shape and t.shape[0] else 1)
    for target in targets:
        o = out.tensors[target.name]
        start = t.start + target.start * row_bytes if t.shape else t.start
        end = t.start + target.end * row_bytes if t.shape else t.end
        out_start = o.start + target.out_offset * row_bytes
        whole = len([x for x in targets if x.name == target.name]) == 1
        if o.dtype != t.dtype or (o.nbytes != end - start if whole else out_start + end - start > o.end):
            report.problem(f"'{target.name}' is {o.dtype} {list(o.shape)}; expected the bytes of '{name}'")
            continue
        for offset in range(0, end - start, 16 * 1024 * 1024):
            n = min(16 * 1024 * 1024, end - start - offset)
            if os.pread(_fd(fds, t.path), n, start + offset) != os.pread(_fd(fds, o.path), n, out_start + offset):
                report.problem(f"'{target.name}' differs from '{name}' of SOURCE (byte range from {offset})")
                break
        else:
            report.identical_tensors += 1


def _check_repo(
    src: Checkpoint, out: Checkpoint, fmt: FormatSpec, renames: dict[str, list[str]], report: VerifyReport
) -> None:
    if set(out.shards) != set(src.shards):
        report.problem(f"OUTPUT's shard files {sorted(out.shards)} are not SOURCE's {sorted(src.shards)}")
    if (src.index is None) != (out.index is None):
        report.problem(f"{INDEX}: present in only one of SOURCE and OUTPUT")
    if out.index is not None:
        weight_map = out.index.get("weight_map", {})
        if set(weight_map) != set(out.tensors):
            report.problem(f"{INDEX}: its weight_map does not list exactly the tensors of OUTPUT's shards")
        total = sum(t.nbytes for t in out.tensors.values())
        if (out.index.get("metadata") or {}).get("total_size") != total:
            report.problem(f"{INDEX}: total_size is not {total}, the sum of OUTPUT's tensor sizes")
    for name, header in out.shards.items():
        if header.metadata.get("format") != "pt":
            report.problem(f"{name}: __metadata__ has no format: pt")
    rewritten = rewrite_name_lists(src.config, src.root, fmt.name_lists, renames)
    if out.config != rewritten.get(CONFIG, (src.config, []))[0]:
        report.problem("config.json: differs from SOURCE's beyond the renamed quantization_config entries")
    for file, (content, _) in rewritten.items():
        if file != CONFIG and (not (out.root / file).is_file() or json.loads((out.root / file).read_text()) != content):
            report.problem(f"{file}: not SOURCE's with the renamed module entries")
    for rel in src.other_files():
        if rel == CARD or rel in rewritten:
            continue
        copied = out.root / rel
        if not copied.is_file() or copied.read_bytes() != (src.root / rel).read_bytes():
            report.problem(f"{rel}: missing from OUTPUT or not a copy of SOURCE's")


def verify_lines(report: VerifyReport) -> list[str]:
    lines = [f"{'faithful' if report.ok else 'MISMATCH'}: {report.summary()}"]
    for w in report.weights:
        if w.kind != "exact":
            rounded = f", {w.rounded_codes} codes rounded" if w.rounded_codes else ""
            lines.append(
                f"  {w.kind:<11} {w.tensor}: max error {w.max_error:.3g} ({w.max_error_steps:.2f} fp8 steps){rounded}"
            )
    lines += [f"  problem: {p}" for p in report.problems]
    return lines
