"""NVFP4 rows moved to a shared global scale: one global scale for the projections a runtime packs into one layer.

vLLM and SGLang pack q / k / v (and gate / up) into one layer with one NVFP4 global scale, the largest (vLLM 0.32
compressed_tensors_w4a4_nvfp4.py: `weight_global_scale.max()`); a projection exported with its own, other global
scale then computes with weights off by the ratio. Written in the multiplier form here (an element's value is
e2m1 x s x m: compressed-tensors' m is 1 / weight_global_scale, ModelOpt's its `weight_scale_2`), the projections
share M, the largest of their multipliers (llm-compressor gives fused projections the smallest global scale, the
same M), and projection i's group scale s becomes s x r with r = m_i / M <= 1: never above e4m3fn's 448.

Where s x r is an e4m3fn value the group keeps every element exactly (its codes unchanged). Elsewhere it is one of
the two e4m3fn values either side of s x r: the nearer, unless the other makes the group's largest error smaller;
each element then the E2M1 value nearest its own (e2m1 x s x r / c, ties to the even, at most 6 in size), the error
bounded and counted. Everything depends on (scale byte, packed byte) only, so each module's ratio gives tables of
both candidates' bytes and errors (256 x 256), and a window of rows is a few numpy lookups (`share_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fp8fix.numerics.dequantize import code_values
from fp8fix.numerics.dtypes import E4M3FN, NAN_CODES
from fp8fix.numerics.mx import E2M1_MAGNITUDES
from fp8fix.numerics.nvfp4 import nvfp4_arrays

#: The E2M1 step at each magnitude (the distance to the next value up; 2 above 4, as below 6).
_E2M1_STEPS = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0)


class SharedScaleNaN(ValueError):
    """A group's scale byte is NaN: no value to move."""

    def __init__(self, row: int, group: int) -> None:
        self.row, self.group = row, group
        super().__init__(f"row {row}, group {group}")


@dataclass
class SharedStats:
    """What moving rows to the shared scale did: groups (of 16), those that keep every value exactly, the largest
    move (in the value's units and in E2M1 steps of the source value, at the source scale)."""

    groups: int = 0
    groups_exact: int = 0
    max_abs: float = 0.0
    max_steps: float = 0.0

    def update(self, other: SharedStats) -> None:
        self.groups += other.groups
        self.groups_exact += other.groups_exact
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_steps = max(self.max_steps, other.max_steps)


@dataclass(frozen=True)
class SharedTable:
    """For one ratio r, flat lookup tables. A group's choice depends only on its scale byte and which E2M1
    magnitudes it holds (an element's error does not depend on its sign), as bits of a mask (`_magnitude_masks`):
    at (scale byte << 8) | mask, the candidate the group takes
    (`choice`: 0 the nearer), its largest error there (in units of the multiplier M) and in E2M1 steps; at
    (candidate << 16) | (scale byte << 8) | packed byte, the new packed byte."""

    candidates: Any  # uint8[256, 2]: per source scale byte, its two candidate scale bytes, the nearer first
    choice: Any  # uint8[65536]
    group_errors: Any  # float64[65536]
    group_steps: Any  # float64[65536]
    packed: Any  # uint8[131072]
    nan: Any  # bool[256]


def _e2m1_nearest(q: Any) -> Any:
    """The E2M1 nibble nearest each value of `q` (ties to the even mantissa; beyond 6 in size: 6), its sign bit
    kept (-0 too)."""
    import numpy as np

    magnitudes = np.array(E2M1_MAGNITUDES)
    a = np.minimum(np.abs(q), 6.0)
    distance = np.abs(a[..., None] - magnitudes)
    best = distance.min(axis=-1, keepdims=True)
    ties = distance == best
    even = ties & (np.arange(8) % 2 == 0)  # E2M1's mantissa bit is the nibble's lowest: even codes win a tie
    pick = np.where(even.any(axis=-1), even.argmax(axis=-1), ties.argmax(axis=-1))
    return (pick | np.where(np.signbit(q), 8, 0)).astype(np.uint8)  # -0 stays -0: a kept group keeps its bytes


def _neighbours(t: Any) -> tuple[Any, Any]:
    """The e4m3fn bytes either side of each |t| (equal where |t| is an e4m3fn value), sign bit of t: the nearer
    (ties: the lower) first."""
    import numpy as np

    values = code_values(E4M3FN)[:0x7F]  # 0 .. 448, ascending with the code
    a = np.abs(t)
    above = np.minimum(np.searchsorted(values, a, side="left"), 0x7E)
    below = np.where(values[above] == a, above, np.maximum(above - 1, 0))
    nearer_above = (values[above] - a) < (a - values[below])
    first = np.where(nearer_above, above, below)
    second = np.where(nearer_above, below, above)
    sign = np.where(np.signbit(t), 0x80, 0)
    return (first | sign).astype(np.uint8), (second | sign).astype(np.uint8)


@lru_cache(maxsize=64)
def shared_table(ratio: float) -> SharedTable:
    """The tables of `ratio` (m_i / M, in (0, 1])."""
    import numpy as np

    scales = code_values(E4M3FN)  # by byte; NaN at 0x7F, 0xFF
    nan = np.zeros(256, dtype=bool)
    nan[list(NAN_CODES[E4M3FN])] = True
    target = np.where(nan, 0.0, scales) * ratio
    first, second = _neighbours(target)
    candidates = np.stack([first, second], axis=1)  # [256, 2]
    e2m1 = np.array([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)])
    steps_at = np.array(_E2M1_STEPS * 2)
    exact = e2m1[None, :] * target[:, None]  # [256 scale, 16 nibble]: each element's value / M
    lo, hi = np.arange(256) & 0x0F, np.arange(256) >> 4  # a packed byte's two nibbles, the lower first
    bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1 == 1  # [mask, magnitude]
    packed, errors, steps = [], [], []
    for k in range(2):
        c = scales[candidates[:, k]]
        c_safe = np.where(c == 0, 1.0, c)
        same = np.arange(16, dtype=np.uint8)[None, :]  # a zero scale: every element zero whatever its nibble: kept
        new = np.where(c[:, None] == 0, same, _e2m1_nearest(exact / c_safe[:, None])).astype(np.uint8)
        err = np.abs(e2m1[new] * c[:, None] - exact)  # [256 scale, 16 nibble]
        unit = steps_at[None, :] * np.abs(target)[:, None]
        step = np.divide(err, unit, out=np.zeros_like(err), where=unit > 0)
        packed.append((new[:, lo] | (new[:, hi] << 4)).astype(np.uint8).reshape(-1))
        # a group's largest error at each (scale byte, mask of magnitudes present): the sign does not matter
        errors.append(np.where(bits[None], err[:, None, :8], 0.0).max(axis=-1).reshape(-1))
        steps.append(np.where(bits[None], step[:, None, :8], 0.0).max(axis=-1).reshape(-1))
    choice = (errors[1] < errors[0]).astype(np.uint8)  # the farther candidate only where it errs less
    pick = choice.astype(bool)
    return SharedTable(
        candidates,
        choice,
        np.where(pick, errors[1], errors[0]),
        np.where(pick, steps[1], steps[0]),
        np.concatenate(packed),
        nan,
    )


def share_rows(
    data: bytes | bytearray | memoryview,
    scales: bytes | bytearray | memoryview,
    cols: int,
    ratio: float,
    multiplier: float,
    first_row: int = 0,
) -> tuple[bytes, bytes, SharedStats]:
    """Rows of packed NVFP4 (`cols` elements each) and their e4m3fn scale bytes [rows, cols / 16] at the shared
    multiplier: (the new packed bytes, the new scale bytes, what moved). `ratio` is the rows' own multiplier over
    the shared one (`multiplier`, M: errors are reported in value units, times it). SharedScaleNaN names the
    first group whose scale is NaN (`first_row`: the rows' index in their weight, for the message)."""
    import numpy as np

    packed, scale_bytes = nvfp4_arrays(data, scales, cols)
    rows, groups = scale_bytes.shape
    table = shared_table(ratio)
    if table.nan[scale_bytes].any():
        row, group = np.argwhere(table.nan[scale_bytes])[0]
        raise SharedScaleNaN(first_row + int(row), int(group))
    masks = _magnitude_masks(packed)  # [rows, groups]: the magnitudes each group holds, as bits
    at = (scale_bytes.astype(np.uint32) << 8) | masks
    pick = table.choice[at]
    new_scales = table.candidates[scale_bytes, pick]
    base = (pick.astype(np.intp) << 16) | (scale_bytes.astype(np.intp) << 8)
    new_packed = np.take(table.packed, np.add(base[..., None], packed, dtype=np.intp))  # (intp: no conversion)
    group_errors = table.group_errors[at]
    stats = SharedStats(
        groups=rows * groups,
        groups_exact=int((group_errors == 0).sum()),
        max_abs=float(group_errors.max(initial=0.0)) * multiplier,
        max_steps=float(table.group_steps[at].max(initial=0.0)),
    )
    return new_packed.tobytes(), new_scales.astype(np.uint8).tobytes(), stats


def _magnitude_masks(packed: Any) -> Any:
    """Per group of 8 packed bytes [rows, groups, 8], the E2M1 magnitudes (nibble & 7) it holds as bits of a byte:
    each byte's two as bits, OR-ed over the group eight bytes at once (as one uint64)."""
    import numpy as np

    one = np.uint8(1)
    bits = (one << (packed & np.uint8(7))) | (one << ((packed >> np.uint8(4)) & np.uint8(7)))
    folded = np.ascontiguousarray(bits).view(np.uint64)[..., 0]
    for shift in (32, 16, 8):
        folded = folded | (folded >> np.uint64(shift))
    return (folded & np.uint64(0xFF)).astype(np.uint8)
