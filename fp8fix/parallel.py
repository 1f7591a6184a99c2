"""Will a block-FP8 checkpoint load at a tensor-parallel size? (`inspect --tp 4,8`)

Each rank of a tensor-parallel group holds a slice of every split module; with block scales the
slice must be a whole number of blocks. For each module with a tensor-parallel role
(`registry.parallel.ROLES`: row-parallel down / o projections, merged gate / up, fused-MoE
experts) and each size asked for, this works out the rank's share and what vLLM 0.32 does when
it is not whole blocks: refuses with its own message, refines the MoE block grid onto slower
kernels, or skips the check; and which sizes load with every share whole. Headers only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from fp8fix.model import CheckpointModel
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
    QKV_OVERFLOW,
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
    if fmt is None or fmt.block is None:
        return None
    report = TensorParallelReport(fmt.block)
    candidates = sorted(set(sizes) | set(COMMON_SIZES))
    found = {tp: _shares(model, fmt.block, tp) for tp in candidates}
    report.sizes = {tp: found[tp] for tp in sizes}
    report.clean_sizes = [tp for tp in candidates if not found[tp]]
    return report


def _shares(model: CheckpointModel, block: tuple[int, int], tp: int) -> list[ModuleShare]:
    out = []
    tensors, config = model.checkpoint.tensors, model.checkpoint.config
    heads = _heads_refusal(config, tp)
    for w in model.module_weights():
        role = role_of(w.module)
        if role is None or w.stacked or len(w.tensor.shape) != 2:
            continue
        if heads is not None and ATTENTION_PROJECTIONS.search(w.module):
            size = w.tensor.shape[1 if role.dimension == "in" else 0]
            out.append(ModuleShare(w.module, role.name, size, None, "refuses", False, heads, HEADS_EVIDENCE))
            continue
        rows, cols = w.tensor.shape
        split = tp
        if role.name == "fused-moe":
            down = DOWN_PROJECTIONS.search(w.module) is not None
            size, hidden = (cols, rows) if down else (rows, cols)
        else:
            size, hidden = (cols if role.dimension == "in" else rows), 0
        if role.name == "qkv" and f"{w.module.rpartition('.')[0]}.k_proj.weight" not in tensors:
            role = COLUMN_PARALLEL  # a q_proj without k_proj (DeepSeek MLA without q_lora_rank): a plain column layer
        elif role.name == "qkv" and KV_PROJECTIONS.search(w.module):
            split = _kv_split(model.checkpoint.config, tp)
        share = _share(w.module, role, size, hidden, block, split)
        if share is not None:
            out.append(share)
    return out


def _heads_refusal(config: dict[str, Any], tp: int) -> str | None:
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
        if refined >= MIN_REFINED_BLOCK:
            message = REFINED_MESSAGE.format(block=block[0], refined=refined, per_rank=per_rank)
            return ModuleShare(module, role.name, size, per_rank, "refines", True, message, MOE_ORACLE, hidden)
        bad_n = per_rank % block[0] != 0
        text = role.message if bad_n else role.second_message
        message = text.format(per_rank=per_rank, block=block[0] if bad_n else block[1])
        return ModuleShare(module, role.name, size, per_rank, "refuses", False, message, role.evidence, hidden)
    if per_rank % b == 0 or (role.name in ("row-parallel", "column-parallel", "qkv") and tp == 1):
        return None
    message = role.message.format(per_rank=per_rank, block=b)
    if role.name == "qkv":  # vLLM rounds each share up to whole scale rows, rank by rank
        length, rows = -(-per_rank // b), -(-size // b)
        if tp * length > rows:
            message += QKV_OVERFLOW.format(start=(tp - 1) * length, length=length, rows=rows)
    behaviour = BEHAVIOURS[role.verdict]
    return ModuleShare(module, role.name, size, per_rank, behaviour, role.verdict == "loads", message, role.evidence)


#: What vLLM does with a share that is not whole blocks, by the role's verdict.
BEHAVIOURS = {"fails": "refuses", "loads": "skips-check", "loads-wrong": "wrong-scales"}
