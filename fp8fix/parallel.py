"""Will a block-FP8 checkpoint load at a tensor-parallel size? (`inspect --tp 4,8`)

Each rank of a tensor-parallel group holds a slice of every split module; with block scales the
slice must be a whole number of blocks. For each module with a tensor-parallel role
(`registry.parallel.ROLES`: row-parallel down / o projections, MLA's column-parallel q_b / kv_b,
q / k / v, merged gate / up, fused-MoE experts) and each size asked for, this works out the
rank's share and what vLLM 0.32 does when it is not whole blocks: refuses with its own message,
refines the MoE block grid onto slower kernels, skips the check, or (layers vLLM packs from
several modules, worked out layer by layer) loads the shards with misaligned scales; attention
whose heads do not split is refused first. Also which sizes load with every share whole. Headers
and config.json only. What it says at TP 1 is also the verdict of the vLLM rows since 0.19 (`verdicts`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from fp8fix.model import CheckpointModel, Fp8Weight
from fp8fix.registry.parallel import (
    ATTENTION_PROJECTIONS,
    COLUMN_PARALLEL,
    DOWN_PROJECTIONS,
    HEADS_EVIDENCE,
    HEADS_MESSAGE,
    INDIVISIBLE_EVIDENCE,
    INDIVISIBLE_MESSAGE,
    KV_PROJECTIONS,
    MIN_REFINED_BLOCK,
    MOE_ORACLE,
    NARROW_ERROR,
    PACKED_EVIDENCE,
    PACKED_FAILURE,
    PACKED_MESSAGE,
    PACKED_SHARDS,
    PARTIAL_REFINED_MESSAGE,
    REFINED_MESSAGE,
    ParallelRole,
    role_of,
)
from fp8fix.report.text import name_pattern

#: Sizes `clean_sizes` looks at besides the ones asked for.
COMMON_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ModuleShare:
    """One module at one tensor-parallel size whose rank share is not whole blocks."""

    module: str
    role: str
    size: int  # the split dimension, whole
    per_rank: int | None  # None: `size` does not split into equal shares
    behaviour: str  # refuses, refines, skips-check, wrong-scales
    loads: bool
    message: str
    evidence: str
    hidden: int = 0  # fused MoE: the hidden size, which bounds the refined block


@dataclass
class TensorParallelReport:
    block: tuple[int, int]
    sizes: dict[int, list[ModuleShare]] = field(default_factory=dict)  # asked size -> modules not whole blocks
    clean_sizes: list[int] = field(default_factory=list)  # sizes where every share is whole blocks

    def groups(self, tp: int) -> list[dict[str, Any]]:
        """The modules at `tp` grouped by what happens to them (one name pattern per group)."""
        grouped: dict[tuple[Any, ...], list[ModuleShare]] = defaultdict(list)
        for share in self.sizes[tp]:
            grouped[(share.role, share.size, share.per_rank, share.behaviour, share.message)].append(share)
        return [
            {
                "modules": name_pattern([s.module for s in members]),
                "count": len(members),
                **{k: v for k, v in asdict(members[0]).items() if k != "module"},
            }
            for members in grouped.values()
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "block": list(self.block),
            "sizes": {str(tp): {"clean": not shares, "modules": self.groups(tp)} for tp, shares in self.sizes.items()},
            "clean_sizes": self.clean_sizes,
            "runtime": "vLLM 0.32",
        }


def tensor_parallel_report(model: CheckpointModel, sizes: list[int]) -> TensorParallelReport | None:
    """The report for block-scaled checkpoints; None for any other (per-tensor and per-channel scales
    split at any size)."""
    fmt = model.format
    if fmt is None or fmt.block is None or fmt.mx:  # MX: not vLLM's FP8 block loading (inspection notes it)
        return None
    report = TensorParallelReport(fmt.block)
    candidates = sorted(set(sizes) | set(COMMON_SIZES))
    found = {tp: _shares(model, fmt.block, tp) for tp in candidates}
    report.sizes = {tp: found[tp] for tp in sizes}
    report.clean_sizes = [tp for tp in candidates if not found[tp]]
    return report


def shares_at(model: CheckpointModel, tp: int) -> list[ModuleShare]:
    """The modules whose share at `tp` is not whole blocks (none for checkpoints without FP8 block scales: MX
    blocks are 32 elements of a row, loaded by vLLM's MXFP8 scheme, not measured here at any size)."""
    fmt = model.format
    return [] if fmt is None or fmt.block is None or fmt.mx else _shares(model, fmt.block, tp)


def _shares(model: CheckpointModel, block: tuple[int, int], tp: int) -> list[ModuleShare]:
    out = []
    config = model.checkpoint.config
    heads = heads_refusal(config, tp)
    weights = {w.module: w for w in model.module_weights() if not w.stacked and len(w.tensor.shape) == 2}
    packed = _packed_layers(weights, tp, heads is None)
    members = {shard for shards in packed.values() for shard in shards}
    for module, w in weights.items():
        role = role_of(module)
        if role is None:
            continue
        if heads is not None and ATTENTION_PROJECTIONS.search(module):
            size = w.tensor.shape[1 if role.dimension == "in" else 0]
            out.append(ModuleShare(module, role.name, size, None, "refuses", False, heads, HEADS_EVIDENCE))
            continue
        if module in packed:
            out += _packed_shares(packed[module], weights, block, tp, config)
        if module in members:  # worked out with its layer
            continue
        rows, cols = w.tensor.shape
        if role.name == "fused-moe":
            down = DOWN_PROJECTIONS.search(module) is not None
            size, hidden = (cols, rows) if down else (rows, cols)
        else:
            size, hidden = (cols if role.dimension == "in" else rows), 0
        if role.name == "qkv":
            role = COLUMN_PARALLEL  # q / k / v outside a full packed layer (MLA's lone q_proj): a plain column layer
        share = _share(module, role, size, hidden, block, tp)
        if share is not None:
            out.append(share)
    return out


def _packed_layers(weights: dict[str, Fp8Weight], tp: int, heads_split: bool) -> dict[str, list[str]]:
    """The first shard of each layer vLLM packs from several FP8 modules that this size is worked out for,
    layer by layer -> the layer's shards: q / k / v (every size whose heads split), gate / up at TP 1 (at
    larger sizes their paired down_proj decides, `ROLES`)."""
    out = {}
    for group in PACKED_SHARDS:
        if group[0] == "gate_proj" and tp > 1 or group[0] == "q_proj" and not heads_split:
            continue
        for module in weights:
            parent, _, leaf = module.rpartition(".")
            if leaf != group[0]:
                continue
            shards = [f"{parent}.{shard}" for shard in group]
            # routed experts' gate / up are the fused-MoE layer's, not a packed linear layer
            if leaf == group[0] and all(s in weights for s in shards) and _role_name(module) != "fused-moe":
                out[module] = shards
    return out


def _packed_shares(
    shards: list[str], weights: dict[str, Fp8Weight], block: tuple[int, int], tp: int, config: dict[str, Any]
) -> list[ModuleShare]:
    """What vLLM 0.32 does with one packed layer's rank shares: each shard's block scales go to offsets and
    sizes rounded up to whole blocks (adjust_block_scale_shard), taken from the checkpoint's scale rows at
    the rank's share rounded up the same way; its kernels read one scale per block of the packed weight.
    A shard that is not whole blocks (the last one only at TP 1, where nothing is sliced) so loads with
    other blocks' scales, or, where a rounded-up range runs past the rows it is read from or written to,
    the load fails on torch's narrow()."""
    b = block[0]
    splits = [_kv_split(config, tp) if KV_PROJECTIONS.search(s) else tp for s in shards]
    rows = [weights[s].tensor.shape[0] for s in shards]
    out = []
    if any(r % n for r, n in zip(rows, splits, strict=True)):
        return [
            ModuleShare(
                s,
                _role_name(s),
                r,
                None,
                "refuses",
                False,
                INDIVISIBLE_MESSAGE.format(size=r, tp=n),
                INDIVISIBLE_EVIDENCE,
            )
            for s, r, n in zip(shards, rows, splits, strict=True)
            if r % n
        ]
    share = [r // n for r, n in zip(rows, splits, strict=True)]
    lengths = [-(-x // b) for x in share]
    offsets = [-(-sum(share[:i]) // b) for i in range(len(share))]
    packed_rows = -(-sum(share) // b)
    failures = [  # (start, length, rows) of each narrow() that runs out: the packed scale, then the shard's own
        *((o, n, packed_rows) for o, n in zip(offsets, lengths, strict=True) if o + n > packed_rows),
        *(((k - 1) * n, n, -(-r // b)) for r, k, n in zip(rows, splits, lengths, strict=True) if k * n > -(-r // b)),
    ]
    for i, (module, x, k) in enumerate(zip(shards, share, splits, strict=True)):
        if x % b == 0 or (k == 1 and i == len(shards) - 1):
            continue
        message = PACKED_MESSAGE.format(per_rank=x, block=b)
        if failures:
            errors = dict.fromkeys(NARROW_ERROR.format(start=a, length=n, rows=r) for a, n, r in failures)
            message += PACKED_FAILURE.format(errors=" / ".join(errors))
        behaviour = "refuses" if failures else "wrong-scales"
        out.append(ModuleShare(module, _role_name(module), rows[i], x, behaviour, False, message, PACKED_EVIDENCE))
    return out


def _role_name(module: str) -> str:
    role = role_of(module)
    assert role is not None
    return role.name


def heads_refusal(config: dict[str, Any], tp: int) -> str | None:
    """vLLM's refusal of attention whose heads do not split `tp` ways (None: they do, or config.json does
    not say how many there are)."""
    heads = _count(config, "num_attention_heads")
    if heads is None:
        return None
    if heads % tp:
        return HEADS_MESSAGE.format(key="num_attention_heads", heads=heads, tp=tp)
    kv = _count(config, "num_key_value_heads")
    if kv is not None and (kv % tp if kv >= tp else tp % kv):
        return HEADS_MESSAGE.format(key="num_key_value_heads", heads=kv, tp=tp)
    return None


def _count(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _kv_split(config: dict[str, Any], tp: int) -> int:
    """How many ways k / v split at `tp`: past num_key_value_heads ranks, vLLM gives each rank one whole
    kv head (replicated), so they split num_key_value_heads ways (QKVParallelLinear num_kv_head_replicas)."""
    heads = _count(config, "num_key_value_heads")
    return tp if heads is None else min(tp, heads)


def _share(
    module: str, role: ParallelRole, size: int, hidden: int, block: tuple[int, int], tp: int
) -> ModuleShare | None:
    """What vLLM 0.32 does with this module's rank share at `tp`; None when it is whole blocks."""
    if size % tp:
        message = INDIVISIBLE_MESSAGE.format(size=size, tp=tp)
        return ModuleShare(module, role.name, size, None, "refuses", False, message, INDIVISIBLE_EVIDENCE)
    per_rank = size // tp
    b = block[role.block_axis]
    if role.name == "fused-moe":  # refine_fp8_moe_block_shape, then validate_fp8_block_shape_moe
        if per_rank % block[0] == 0 and (tp == 1 or per_rank % block[1] == 0):
            return None
        refined = math.gcd(block[0], block[1], per_rank, hidden)
        if refined >= MIN_REFINED_BLOCK and tp == 1 and size % block[0]:
            # the scales are allocated for the refined grid of the rows, but loaded as the checkpoint's grid
            # (its partial last block included) upsampled by block / refined: one column or row too many
            a, b = -(-per_rank // refined), -(-size // block[0]) * (block[0] // refined)
            message = PARTIAL_REFINED_MESSAGE.format(a=a, b=b)
            return ModuleShare(module, role.name, size, per_rank, "refuses", False, message, MOE_ORACLE, hidden)
        if refined >= MIN_REFINED_BLOCK:
            message = REFINED_MESSAGE.format(block=block[0], refined=refined, per_rank=per_rank)
            return ModuleShare(module, role.name, size, per_rank, "refines", True, message, MOE_ORACLE, hidden)
        bad_n = per_rank % block[0] != 0
        text = role.message if bad_n else role.second_message
        message = text.format(per_rank=per_rank, block=block[0] if bad_n else block[1])
        return ModuleShare(module, role.name, size, per_rank, "refuses", False, message, role.evidence, hidden)
    if per_rank % b == 0 or (tp == 1 and role.name in ("row-parallel", "column-parallel", "merged-column")):
        return None
    message = role.message.format(per_rank=per_rank, block=b)
    behaviour = BEHAVIOURS[role.verdict]
    return ModuleShare(module, role.name, size, per_rank, behaviour, role.verdict == "loads", message, role.evidence)


#: What vLLM does with a share that is not whole blocks, by the role's verdict.
BEHAVIOURS = {"fails": "refuses", "loads": "skips-check"}
