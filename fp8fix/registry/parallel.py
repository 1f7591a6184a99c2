"""What vLLM 0.32 does with a block-FP8 module whose tensor-parallel slice is not whole blocks, as data.

Each module of an MLP or of attention has a role in tensor parallelism, read off its name: the
dimension vLLM splits across ranks, and what vLLM does when a rank's share is not a whole number
of blocks. Every rule cites the vLLM 0.32 source it comes from; tests/loaders/test_tensor_parallel.py
calls vLLM's block-shape functions with the partition sizes `fp8fix inspect --tp` reports, and
tests/loaders/test_tp_load.py loads what the rules for packed layers and heads say, so the table
cannot drift from the code. Other runtimes and
other vLLM versions differ (the issue tracker has per-model fixes); fp8fix claims nothing
about them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from fp8fix.vocab import Verdict

FP8_UTILS = "vllm 0.32 model_executor/layers/quantization/utils/fp8_utils.py"
MOE_ORACLE = "vllm 0.32 model_executor/layers/fused_moe/oracle/fp8.py"
LINEAR = "vllm 0.32 model_executor/layers/linear.py"


#: A layer vLLM packs from several modules (q / k / v at any size; gate / up at TP 1, where no down_proj
#: check stops it first) whose rank share of a shard is not whole blocks: the layer skips the block check,
#: and each shard's block scales go to offsets and sizes rounded up to whole blocks, read from the shard's
#: own scale rows at the rank's share rounded up the same way, while the kernels read one scale per block
#: of the packed weight. tests/loaders/test_tp_load.py loads both outcomes.
PACKED_MESSAGE = (
    "vLLM packs q / k / v (gate / up) into one layer, skips its block check (allow_fp8_block_shape_mismatch) "
    "and puts each shard's block scales at offsets and sizes rounded up to whole blocks of {block} "
    "(adjust_block_scale_shard): with {per_rank} rows per rank they do not line up with the rows, which are "
    "scaled by other blocks' scales"
)
PACKED_FAILURE = "; a rounded-up range runs out, so loading fails (torch's narrow): {errors}"
NARROW_ERROR = "start ({start}) + length ({length}) exceeds dimension size ({rows})."
PACKED_EVIDENCE = (
    "vllm 0.32 model_executor/layers/linear.py _maybe_allow_fp8_block_shape_mismatch, adjust_block_scale_shard, "
    "QKVParallelLinear / MergedColumnParallelLinear.weight_loader_v2; model_executor/parameter.py "
    "_ColumnvLLMParameter.load_qkv_weight / load_merged_column_weight"
)


@dataclass(frozen=True)
class ParallelRole:
    """How vLLM splits a module across tensor-parallel ranks, and what it does with a partial block."""

    name: str  # row-parallel, column-parallel, qkv, merged-column, fused-moe
    pattern: re.Pattern[str]  # matched against the module path
    dimension: str  # the split dimension: "in" (columns) or "out" (rows) of the [out, in] weight
    block_axis: int  # the block size that must divide a rank's share: 0 block_n (rows), 1 block_k (columns)
    verdict: Verdict  # vLLM 0.32's answer when the share is not whole blocks
    message: str  # vLLM's own error text or behaviour, formatted with {per_rank}, {block}
    evidence: str
    second_message: str = ""  # fused MoE: when block_n divides the share but block_k does not (TP > 1)


#: The roles, first match wins. MLP modules of dense layers and shared experts are vLLM's
#: MergedColumnParallelLinear (gate_up) and RowParallelLinear (down); routed experts go to the fused
#: MoE layer, which checks (and may refine) the intermediate share of gate, up and down together.
ROLES: tuple[ParallelRole, ...] = (
    ParallelRole(  # gate / up: the intermediate is their rows; down: its columns
        "fused-moe",
        re.compile(r"(^|\.)experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"),
        "intermediate",
        0,
        "fails",
        "The output_size of gate's and up's weight = {per_rank} is not divisible by weight quantization "
        "block_n = {block}.",
        f"{FP8_UTILS} validate_fp8_block_shape_moe; {MOE_ORACLE} refine_fp8_moe_block_shape",
        "The input_size of down's weight = {per_rank} is not divisible by weight quantization block_k = {block}.",
    ),
    ParallelRole(
        "row-parallel",
        re.compile(r"(^|\.)(down_proj|o_proj|dense_4h_to_h)$"),
        "in",
        1,
        "fails",
        "Weight input_size_per_partition = {per_rank} is not divisible by weight quantization block_k = {block}.",
        f"{FP8_UTILS} validate_fp8_block_shape (row parallel)",
    ),
    ParallelRole(  # DeepSeek's MLA up-projections: plain ColumnParallelLinear in vLLM's deepseek_v2.py
        "column-parallel",
        re.compile(r"(^|\.)(q_b_proj|kv_b_proj)$"),
        "out",
        0,
        "fails",
        "Weight output_partition_size = {per_rank} is not divisible by weight quantization block_n = {block}.",
        f"{FP8_UTILS} validate_fp8_block_shape (column parallel)",
    ),
    ParallelRole(  # q / k / v: QKVParallelLinear, worked out layer by layer (fp8fix/parallel.py)
        "qkv", re.compile(r"(^|\.)(q_proj|k_proj|v_proj)$"), "out", 0, "loads-wrong", PACKED_MESSAGE, PACKED_EVIDENCE
    ),
    ParallelRole(
        "merged-column",
        re.compile(r"(^|\.)(gate_proj|up_proj|gate_up_proj)$"),
        "out",
        0,
        "loads",
        "merged gate/up layers skip the block check (allow_fp8_block_shape_mismatch); the paired down_proj "
        "is checked instead",
        f"{LINEAR} MergedColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch; "
        f"{FP8_UTILS} validate_fp8_block_shape",
    ),
)

#: The finest block vLLM 0.32 refines fused-MoE scales to (gcd of the blocks, the share and hidden).
MIN_REFINED_BLOCK = 32
REFINED_MESSAGE = (
    "FP8 MoE block scales refined from {block}x{block} to {refined}x{refined} to fit the TP-sharded "
    "intermediate size {per_rank}: only the Triton MoE kernels take refined blocks (no DeepGEMM / CUTLASS "
    "block kernels: slower)"
)


#: A checkpoint whose fused-MoE intermediate is not whole blocks, at TP 1: vLLM 0.32 refines the blocks (as
#: at TP > 1) and allocates the refined grid of the rows, then loads the checkpoint's grid, its partial last
#: block included, upsampled: torch's broadcast error (issue 24: intermediate 320, `a (5)` vs `b (6)`).
PARTIAL_REFINED_MESSAGE = "The size of tensor a ({a}) must match the size of tensor b ({b})"


def role_of(module: str) -> ParallelRole | None:
    """The first role whose pattern matches `module`. Every pattern of `ROLES` reads at most the module's
    last three path components (`experts.N.leaf`), so the answer is looked up by those: a DeepSeek-V3
    has 45k expert modules and a few hundred distinct endings (tests/test_parallel.py checks the claim)."""
    return _role_of_ending(".".join(module.rsplit(".", ROLE_COMPONENTS)[-ROLE_COMPONENTS:]))


#: How many trailing path components `ROLES`' patterns read.
ROLE_COMPONENTS = 3


@functools.lru_cache(maxsize=4096)
def _role_of_ending(ending: str) -> ParallelRole | None:
    return next((r for r in ROLES if r.pattern.search(ending)), None)


#: The column-parallel role, for a `q_proj` that vLLM builds as a plain ColumnParallelLinear (no k_proj
#: beside it: DeepSeek-V2's MLA without q_lora_rank, models/deepseek_v2.py).
COLUMN_PARALLEL = next(r for r in ROLES if r.name == "column-parallel")
#: Modules vLLM builds as one layer (its packed_modules_mapping): every shard must be quantized alike, or
#: is_layer_skipped raises ("... but not all shards ... are quantized"), so a module written in BF16
#: takes its siblings with it (vllm 0.32 model_executor/layers/quantization/utils/quant_utils.py).
PACKED_SHARDS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def packed_siblings(module: str) -> list[str]:
    """`module` and the other shards of the vLLM layer it is packed into (itself alone if none)."""
    parent, _, leaf = module.rpartition(".")
    shards = next((group for group in PACKED_SHARDS if leaf in group), (leaf,))
    return [f"{parent}.{shard}" if parent else shard for shard in shards]


#: k / v: split num_key_value_heads ways at most (each rank past that holds one replicated kv head).
KV_PROJECTIONS = re.compile(r"(^|\.)(k_proj|v_proj)$")


#: Attention projections, split across ranks by heads: a size that does not divide the heads is refused
#: before any block matters (vLLM 0.32's attention classes, e.g. models/qwen3_moe.py Qwen3MoeAttention:
#: `assert self.total_num_heads % tp_size == 0`, and for kv heads `total_num_kv_heads % tp_size == 0`
#: when there are at least tp_size of them, else `tp_size % total_num_kv_heads == 0`).
ATTENTION_PROJECTIONS = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|q_b_proj|kv_b_proj)$")
HEADS_MESSAGE = "{key} = {heads} does not split {tp} ways (vLLM's attention asserts it)"
HEADS_EVIDENCE = "vllm 0.32 model_executor/models/qwen3_moe.py Qwen3MoeAttention (as every attention class)"

#: The checkpoint's rows or columns do not split into equal shares at all (vLLM's ensure_divisibility).
INDIVISIBLE_MESSAGE = "{size} is not divisible by {tp}"
INDIVISIBLE_EVIDENCE = "vllm 0.32 distributed/utils.py ensure_divisibility (via divide)"
#: Modules whose intermediate is their columns (the rest of a fused MoE's modules: their rows).
DOWN_PROJECTIONS = re.compile(r"(^|\.)(down_proj|w2)$")

#: `--tp` padding: the config.json size of each MLP's intermediate, by the MLP module's path (first
#: match), as an expression over config.json. vLLM 0.32 sizes them so: models/qwen3_moe.py and
#: deepseek_v2.py (routed experts: moe_intermediate_size), qwen2_moe.py (shared_expert:
#: shared_expert_intermediate_size), deepseek_v2.py and glm4_moe.py (shared_experts:
#: moe_intermediate_size * n_shared_experts), every dense MLP (intermediate_size).
PADDED_SIZES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.experts\.\d+$"), "moe_intermediate_size"),
    (re.compile(r"\.shared_expert$"), "shared_expert_intermediate_size"),
    (re.compile(r"\.shared_experts$"), "moe_intermediate_size * n_shared_experts"),
    (re.compile(r"(^|\.)mlp$"), "intermediate_size"),
)


def padded_size_of(mlp: str) -> str | None:
    """The config expression sizing the intermediate of the MLP module `mlp`; None when unknown."""
    return next((expression for pattern, expression in PADDED_SIZES if pattern.search(mlp)), None)


_PROJECTION = re.compile(r"^(.*)\.(gate_proj|up_proj|down_proj)\.weight$")


def mlp_weights(shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, str]]:
    """MLP module path -> {gate_proj, up_proj, down_proj: weight tensor name}, for every module with all
    three as 2-D tensors (any dtype), from tensor names and shapes."""
    found: dict[str, dict[str, str]] = {}
    for name, shape in shapes.items():
        m = _PROJECTION.match(name)
        if m and len(shape) == 2:
            found.setdefault(m.group(1), {})[m.group(2)] = name
    return {mlp: w for mlp, w in found.items() if len(w) == 3}
