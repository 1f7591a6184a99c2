"""Load checkpoints with the real vLLM (CPU build) and dump what it ends up with.

Run with the vLLM venv's Python (see docs/real-loaders.md), never imported by
the test suite itself: `python vllm_load.py OUT_DIR CHECKPOINT...`. For each checkpoint
it runs vLLM's own model loading, unmodified: the architecture's model class,
`load_weights` with the parameter weight loaders, and `process_weights_after_loading`
(where vLLM requantizes fused shards). Then, for every FP8 linear layer, it writes the
dequantized float32 weight [out, in] as vLLM will compute with it, into
OUT_DIR/<n>/weights.safetensors, and OUT_DIR/<n>/result.json with the model class or the
error vLLM raised, and per attention layer the kv cache's dtype and the k / v scales it ended
with (`kv_cache`). The call is `LLM(path)` with defaults; FP8FIX_VLLM_KV_CACHE_DTYPE=fp8 makes it
the call with `--kv-cache-dtype fp8`.

Patches, each only where the CPU build lacks a GPU kernel or device, never in weight
loading:
- `torch.cpu._is_amx_tile_supported` says False: on a CPU with AMX tiles (Sapphire Rapids or newer) the CPU
  build picks AMX kernels whose `process_weights_after_loading` VNNI-packs FP8 and plain weights (bytes
  reordered in the same shape) or moves MoE weights, so what the harness reads back would depend on the
  machine CI lands on. Without AMX every CPU takes the same kernels, which keep the loaded weights as they
  are (a GPU computes with the loaded weights too; only the CPU build repacks).
- `torch.accelerator.empty_cache`: vLLM frees the GPU cache between loading and
  processing; there is no accelerator here, so it is a no-op.
- `vllm._custom_ops.scaled_fp8_quant` with a static per-tensor scale: the CPU build
  registers `_C::static_scaled_fp8_quant` without arguments. The replacement follows the
  CUDA kernel (csrc/quantization/w8a8/fp8/common.cuh, `scaled_fp8_conversion`): divide by
  the scale in float32, clamp to the platform's FP8 range (`current_platform.fp8_dtype()`, as
  `_custom_ops.scaled_fp8_quant` allocates its output), round to nearest even.
- `CPUFp8BlockScaledMMKernel` (kernels/linear/scaled_mm/cpu.py), the CPU build's block-FP8
  matmul, needs AMX tiles and 128-wide K blocks: it is allowed here, and its
  `process_weights_after_loading`, which only VNNI-packs the weight for AMX, leaves the
  loaded weight as it is. Block-shape checks and weight loading are vLLM's own.
- With FP8FIX_VLLM_ROCM=1, the platform's FP8 switches say what vLLM's ROCm platform says on MI300
  (platforms/rocm.py: `is_fp8_fnuz()` True, `fp8_dtype()` float8_e4m3fnuz), so the weight loading and
  `process_weights_after_loading` take their ROCm branches (normalize_e4m3fn_to_e4m3fnuz: codes and
  doubled scales, then the fused-shard requantization). Kernels stay the CPU build's.
- With FP8FIX_VLLM_UE8M0=1, the block-FP8 kernel's `process_weights_after_loading` does what vLLM's DeepGEMM
  kernel does on Hopper / Blackwell with `use_e8m0` on (kernels/linear/scaled_mm/deep_gemm.py ->
  quantization/utils/fp8_utils.py deepgemm_post_process_fp8_weight_block, whose condition is
  utils/deep_gemm.py is_deep_gemm_e8m0_used: DeepGEMM present and VLLM_USE_DEEP_GEMM_E8M0, default on): for
  float32 block scales, vLLM's own `requant_weight_ue8m0_inplace` on the loaded weight and scale. The
  condition, which needs a GPU with DeepGEMM, is what is forced; the requantization is vLLM's code.
- Releases before 0.32 (the era rows, each in its own venv: scripts/setup_loader_venvs.sh), only what their CPU
  build lacks that a GPU has, so weight loading takes the path an H100 takes: the platform reports compute
  capability 9.0 (without it compressed-tensors picks its W8A16 scheme, which has no CPU kernel, where a GPU
  takes W8A8); the CPU attention backend and platform check accept an FP8 kv cache (they refuse it, or set it
  back to BF16, where a GPU backend keeps it: the dtype the call resolved is kept after the check); where the
  CPU build has no block-FP8 kernel (0.20), the Triton one a GPU selects is allowed (its
  `process_weights_after_loading` is vLLM's own: the ROCm normalization and padding); 0.19 and earlier build
  block FP8 without kernel selection. Their compiled ops need not load (0.21's do not beside this torch):
  every op weight loading uses on CPU is either Python or replaced above (`scaled_fp8_quant`). 0.17 - 0.18
  (measured once, not in CI) probe `torch._C._cpu._is_avx512_supported`, which torch 2.13 moved to
  `torch.cpu`: it is put back; 0.17 inspects model classes in a subprocess, which would not have it: in
  process (the subprocess only keeps CUDA out of the parent).
- `UnquantizedLinearMethod.process_weights_after_loading` keeps a copy of each plain layer's loaded weight
  (`_fp8fix_loaded`) before the CPU build repacks it for its GEMM and drops it
  (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`), so unquantized layers (`convert --to bf16`,
  `--dequantize`) can be read back; what it then does is vLLM's own.
- `UnquantizedFusedMoEMethod.process_weights_after_loading` likewise keeps each unquantized MoE layer's loaded
  `w13_weight` / `w2_weight` (`_fp8fix_loaded_experts`) before 0.31 and later repack them for the CPU's MoE kernel
  (the same values, reordered), so unquantized experts (gpt-oss `--to bf16`) can be read back.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402

torch.cpu._is_amx_tile_supported = lambda: False  # before vLLM looks (module docstring)
if not hasattr(torch._C._cpu, "_is_avx512_supported"):  # vLLM 0.17 - 0.18 probe it; torch 2.13 dropped it
    torch._C._cpu._is_avx512_supported = torch.cpu._is_avx512_supported
import vllm  # noqa: E402
import vllm._custom_ops as ops  # noqa: E402
from harness import dequantized_layer, local_address, run, scale_of  # noqa: E402  (this folder, first on sys.path when run as a script)
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402
from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

if os.environ.get("FP8FIX_VLLM_ROCM") == "1":  # MI300's FP8 (module docstring)
    type(current_platform).is_fp8_fnuz = classmethod(lambda cls: True)
    type(current_platform).fp8_dtype = classmethod(lambda cls: torch.float8_e4m3fnuz)

_scaled_fp8_quant = ops.scaled_fp8_quant


def static_scaled_fp8_quant(input, scale=None, *args, **kwargs):  # type: ignore[no-untyped-def]
    if scale is None or scale.numel() != 1:
        return _scaled_fp8_quant(input, scale, *args, **kwargs)
    fp8 = current_platform.fp8_dtype()  # as the op allocates its output: e4m3fnuz where ROCm's switches are on
    limit = torch.finfo(fp8).max
    return (input.float() / scale.float()).clamp(-limit, limit).to(fp8), scale


torch.accelerator.empty_cache = lambda: None
ops.scaled_fp8_quant = static_scaled_fp8_quant
RELEASE = tuple(int(part) for part in vllm.__version__.split(".")[:2])
if RELEASE < (0, 32):  # what an H100 selects (module docstring)
    import vllm.platforms.cpu as cpu_platform
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm.platforms.interface import DeviceCapability

    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    for module in (cpu_attn, cpu_platform):
        if hasattr(module, "is_quantized_kv_cache"):
            module.is_quantized_kv_cache = lambda kv_cache_dtype: False
    check_config = type(current_platform).check_and_update_config.__func__

    def keep_kv_cache_dtype(cls, vllm_config):  # type: ignore[no-untyped-def]
        """The CPU platform's own config check, but the kv cache dtype stays what the call resolved (0.19's
        check sets an FP8 one back to "auto"; a GPU platform keeps it)."""
        dtype = vllm_config.cache_config.cache_dtype
        check_config(cls, vllm_config)
        vllm_config.cache_config.cache_dtype = dtype

    type(current_platform).check_and_update_config = classmethod(keep_kv_cache_dtype)
if RELEASE < (0, 18):  # it inspects model classes in a subprocess (to keep CUDA out), without the patch above
    import vllm.model_executor.models.registry as model_registry

    model_registry._run_in_subprocess = lambda fn: fn()
BlockKernel: type | None
try:
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel as BlockKernel
except ImportError:  # vLLM 0.20: no CPU block-FP8 kernel; a GPU's Triton one (module docstring)
    try:
        import vllm.model_executor.kernels.linear as linear_kernels
        from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel as BlockKernel
        from vllm.platforms.interface import PlatformEnum
    except ImportError:  # before 0.20: block FP8 through W8A8BlockFp8LinearOp, no kernel selection
        BlockKernel = None
    else:
        linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] = [BlockKernel]
else:
    BlockKernel.can_implement = classmethod(lambda cls, config: (True, None))
if BlockKernel is not None:
    BlockKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))


def block_weights_after_loading(self, layer):  # type: ignore[no-untyped-def]
    """Nothing (AMX packing only), or with FP8FIX_VLLM_UE8M0=1 vLLM's UE8M0 requantization (module docstring)."""
    if os.environ.get("FP8FIX_VLLM_UE8M0") != "1":
        return
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace

    params = self._get_layer_params(layer)
    scale = params.block_scale
    if scale is not None and scale.dtype == torch.float32:  # as deepgemm_post_process_fp8_weight_block checks
        requant_weight_ue8m0_inplace(params.weight.data, scale.data, block_size=tuple(layer.weight_block_size))


if BlockKernel is not None and BlockKernel.__name__ == "CPUFp8BlockScaledMMKernel":  # Triton's: a GPU's own
    BlockKernel.process_weights_after_loading = block_weights_after_loading
_process_unquantized = UnquantizedLinearMethod.process_weights_after_loading


def keep_loaded_weight(self, layer):  # type: ignore[no-untyped-def]
    layer._fp8fix_loaded = layer.weight.detach().clone()
    _process_unquantized(self, layer)


UnquantizedLinearMethod.process_weights_after_loading = keep_loaded_weight
_process_unquantized_moe = UnquantizedFusedMoEMethod.process_weights_after_loading


def keep_loaded_experts(self, layer):  # type: ignore[no-untyped-def]
    layer._fp8fix_loaded_experts = {p: getattr(layer, p).detach().clone() for p in ("w13_weight", "w2_weight")}
    _process_unquantized_moe(self, layer)


UnquantizedFusedMoEMethod.process_weights_after_loading = keep_loaded_experts


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's weight as vLLM multiplies with it, [out, in] in float32."""
    block = getattr(layer, "weight_block_size", None)  # Fp8LinearMethod's, from the checkpoint's config
    return dequantized_layer(layer, layer.output_size_per_partition, layer.input_size_per_partition, block)


_DISTRIBUTED: list[bool] = []


def build_model(folder: Path, tp: int = 1, rank: int = 0) -> torch.nn.Module:
    """vLLM's model for `folder`, weights loaded, as rank `rank` of a tensor-parallel group of `tp`: the
    process group has one member; the TP group's size and rank (what get_tensor_model_parallel_world_size
    and _rank return) are set before the model is built, so every layer holds that rank's slice."""
    args = EngineArgs(
        model=str(folder),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="auto",  # the default: config.json's dtype (a --to float16 output is built in float16)
        max_model_len=64,
        # the default, "auto"; FP8FIX_VLLM_KV_CACHE_DTYPE=fp8 is the call with --kv-cache-dtype fp8
        kv_cache_dtype=os.environ.get("FP8FIX_VLLM_KV_CACHE_DTYPE", "auto"),
        load_format="safetensors",
        # MiMo-V2.5's config class ships with the checkpoint (tests/builders.mimo_v2); DeepSeek's auto_map
        # names remote code the test checkpoints do not carry, and transformers has its config class
        trust_remote_code=any(folder.glob("configuration_*.py")),
    )
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        if not _DISTRIBUTED:  # one process group of one rank for every checkpoint
            init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=local_address(), local_rank=0, backend="gloo"
            )
            ensure_model_parallel_initialized(1, 1)
            _DISTRIBUTED.append(True)
        group = parallel_state.get_tp_group()
        group.world_size, group.rank_in_group = tp, rank
        model = get_model(vllm_config=config)
        model._fp8fix_quantization = config.model_config.quantization  # the method vLLM chose (None: none)
        return model


def unquantized_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each MoE layer's unquantized expert weights as loaded (`keep_loaded_experts`), float32 (`<layer>.w13_weight`
    [experts, 2 x intermediate, hidden], `<layer>.w2_weight` [experts, hidden, intermediate]); quantized ones are not
    read here."""
    found = {}
    for name, module in model.named_modules():
        for param, w in getattr(module, "_fp8fix_loaded_experts", {}).items():
            found[f"{name}.{param}"] = w.float().contiguous()
    return found


def load(folder: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    model = build_model(folder)
    layers = {
        name: module
        for name, module in model.named_modules()
        if (hasattr(module, "weight_scale") or hasattr(module, "weight_scale_inv"))
        and getattr(module, "weight", None) is not None
    }
    weights = {name: dequantized(module).contiguous() for name, module in layers.items()}
    plain = {  # unquantized linear layers, as loaded (see keep_loaded_weight)
        name: module._fp8fix_loaded.float().contiguous()
        for name, module in model.named_modules()
        if name not in layers and isinstance(getattr(module, "_fp8fix_loaded", None), torch.Tensor)
    }
    weights.update({name: w for name, w in plain.items() if name != "lm_head"})
    weights.update(unquantized_experts(model))
    head = getattr(model, "lm_head", None)  # vLLM's ParallelLMHead: never quantized by these formats
    unreadable = []
    if isinstance(getattr(head, "weight", None), torch.Tensor) and head.weight.numel():
        weights["lm_head"] = head.weight.float().contiguous()
    elif head is not None:  # the CPU build's UnquantizedLinearMethod repacks it for its GEMM (an empty weight)
        unreadable.append("lm_head")
    # the scale each layer ended with: where vLLM requantized at load, the grid its values lie on
    weights.update(
        {f"{name}::scale": scale_of(module).float().reshape(-1).contiguous() for name, module in layers.items()}
    )
    quantization = model._fp8fix_quantization
    return {
        "loaded": True,
        "model_class": type(model).__name__,
        "unreadable": unreadable,
        "quantization": quantization,
        "kv_cache": kv_cache_scales(model),
    }, weights


def kv_cache_scales(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Per attention layer, the kv cache's dtype and the k / v scales it ended with (vLLM keeps them as
    `_k_scale` / `_v_scale`, 1.0 where no checkpoint scale was loaded): whether a checkpoint's kv-cache
    scales are used (an FP8 cache at those scales), loaded but unused, or ignored."""
    layers = {}
    for name, module in model.named_modules():
        if hasattr(module, "kv_cache_dtype") and hasattr(module, "_k_scale"):
            layers[name] = {
                "dtype": str(module.kv_cache_dtype),
                "k_scale": module._k_scale.float().reshape(-1).tolist(),
                "v_scale": module._v_scale.float().reshape(-1).tolist(),
            }
    return layers


if __name__ == "__main__":
    run(load)
