"""Ask vLLM 0.32's own block-shape code what it does with tensor-parallel shares (run with the vLLM
venv's Python: `python vllm_tp_check.py CASES.json`; prints one JSON result per case).

Each case is a module's role, its split dimension, the TP size, the block and (fused MoE) the hidden
size. The functions called are vLLM's, unmodified: `validate_fp8_block_shape` (with a layer object
holding `tp_size`, as LinearBase sets it, and the mismatch allowance merged layers compute with
`_maybe_allow_fp8_block_shape_mismatch`), `refine_fp8_moe_block_shape` and
`validate_fp8_block_shape_moe` (the TP world size it asks `vllm.distributed` for is the case's).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import vllm.distributed  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle.fp8 import refine_fp8_moe_block_shape  # noqa: E402
from vllm.model_executor.layers.linear import ColumnParallelLinear  # noqa: E402
from vllm.model_executor.layers.quantization.utils.fp8_utils import (  # noqa: E402
    validate_fp8_block_shape,
    validate_fp8_block_shape_moe,
)


def check(case: dict) -> dict:
    tp, size, block, role = case["tp"], case["size"], case["block"], case["role"]
    per_rank = size // tp
    vllm.distributed.get_tensor_model_parallel_world_size = lambda: tp
    try:
        if role == "fused-moe":
            moe = SimpleNamespace(intermediate_size_per_partition=per_rank, tp_size=tp, hidden_dim=case["hidden"])
            refined = refine_fp8_moe_block_shape(moe, block)
            if refined is not None:
                return {"raises": False, "refined": refined, "message": None}
            validate_fp8_block_shape_moe(per_rank, block)
        elif role == "row-parallel":
            layer = SimpleNamespace(tp_size=tp, prefix=case["module"])
            validate_fp8_block_shape(layer, size, case["other"], per_rank, [case["other"]], block)
        elif role == "column-parallel":
            layer = SimpleNamespace(tp_size=tp, prefix=case["module"])
            validate_fp8_block_shape(layer, case["other"], size, case["other"], [per_rank], block)
        elif role == "merged-column":  # gate and up, one share each
            layer = SimpleNamespace(
                tp_size=tp,
                prefix=case["module"],
                quant_config=SimpleNamespace(weight_block_size=block),
                output_partition_sizes=[per_rank, per_rank],
            )
            ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch(layer)
            validate_fp8_block_shape(layer, case["other"], 2 * size, case["other"], [per_rank, per_rank], block)
        else:
            raise ValueError(f"unknown role {role}")
    except ValueError as e:
        return {"raises": True, "refined": None, "message": str(e)}
    return {"raises": False, "refined": None, "message": None}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    print(json.dumps([check(c) for c in cases]))
