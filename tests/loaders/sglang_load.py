"""Load checkpoints with the real SGLang (0.5.23, its own model classes and weight loading) on CPU and dump
what it ends up with.

Run with the SGLang venv's Python (scripts/setup_loader_venvs.sh), never imported by the test suite:
`python sglang_load.py OUT_DIR CHECKPOINT...`. For each checkpoint it runs SGLang's model loading as
`sglang.launch_server --model-path PATH` does with defaults (`ServerArgs(model_path=...)`, the published
server args, TP 1): `get_model` builds the architecture's model class, `load_weights` runs the parameter
weight loaders, and `postprocess_weights` each quantization method's `process_weights_after_loading` (where
SGLang requantizes fused shards). Then, for every FP8 linear layer, it writes the dequantized float32 weight
[out, in] SGLang will compute with, and its scale, into OUT_DIR/<n>/weights.safetensors, and
OUT_DIR/<n>/result.json with the model class or the error SGLang raised, as vllm_load.py does.

Stubs, each outside weight loading (SGLang's CPU tests stub `sgl_kernel` the same way):
- `torch.cpu._is_amx_tile_supported` says False, as in vllm_load.py: SGLang's AMX backend would repack
  loaded weights (it also needs `sgl_kernel`'s packing op, which the stub lacks), so every CPU reads back the
  weights as loaded.
- `torchvision`, `vllm`, `sgl_kernel`: imported by multimodal configs, the rotary embedding's CUDA op and the
  kernel package at import or layer construction, never called while loading weights; stub modules whose
  every attribute is a placeholder (a call on one in weight loading would fail the load, not pass it),
  installed after transformers is imported, so transformers still sees no torchvision.
- `torch.cuda.get_device_capability` and SGLang's `utils.get_device_capability` say (9, 0), an H100:
  compressed-tensors', Quark's and FP8's scheme selection check the device's FP8 support before choosing a
  W8A8 FP8 scheme, as on the GPUs SGLang serves FP8 on.
- `sgl_per_tensor_quant_fp8` (kernels/ops/quantization/fp8_kernel.py), the CUDA op behind
  `scaled_fp8_quant`, for a static per-tensor scale: divide by the scale in float32, clamp to the FP8 dtype's
  range, round to nearest even (what `requantize_with_max_scale` runs when fused shards' scales differ; its
  dynamic variants are not stubbed and fail).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from pathlib import Path
from typing import Any

os.environ.setdefault("SGLANG_LOGGING_LEVEL", "ERROR")
STUBBED = {"torchvision", "vllm", "sgl_kernel"}


class _Placeholder:
    """Any attribute, call or base class of a stubbed module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


import torch  # noqa: E402

torch.cpu._is_amx_tile_supported = lambda: False  # before SGLang looks: no AMX packing, on any CPU (docstring)
import transformers  # noqa: E402, F401  (before the stubs: it must find no torchvision, as it is not installed)

sys.meta_path.insert(0, _StubFinder())

torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)  # an H100 (module docstring)
import sglang.srt.utils  # noqa: E402
import sglang.srt.utils.common  # noqa: E402

# SGLang's own helper too (Quark's and FP8's scheme checks), before the modules that import it by name
sglang.srt.utils.get_device_capability = sglang.srt.utils.common.get_device_capability = (
    torch.cuda.get_device_capability
)
import sglang.kernels.ops.quantization.fp8_kernel as fp8_kernel  # noqa: E402
from harness import dequantized_layer, local_address, run, scale_of  # noqa: E402  (this folder, first on sys.path when run as a script)
from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from sglang.srt.model_loader import get_model  # noqa: E402
from sglang.srt.runtime_context import derive_spawn_ranks, get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402


def sgl_per_tensor_quant_fp8(input, output, scale, is_static):  # type: ignore[no-untyped-def]
    if not is_static:
        raise NotImplementedError("dynamic per-tensor FP8 quantization: a CUDA op, not stubbed")
    limit = torch.finfo(output.dtype).max
    output.copy_((input.float() / scale.float()).clamp(-limit, limit).to(output.dtype))


fp8_kernel.sgl_per_tensor_quant_fp8 = sgl_per_tensor_quant_fp8
_STARTED: list[bool] = []


def server_args(folder: Path) -> ServerArgs:
    """`sglang.launch_server --model-path folder` with defaults, on CPU, published as the scheduler's."""
    args = ServerArgs(model_path=str(folder), device="cpu", skip_tokenizer_init=True)
    set_global_server_args_for_scheduler(args)
    if not _STARTED:  # one process group of one rank for every checkpoint, TP 1
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=local_address(), local_rank=0, backend="gloo"
        )
        initialize_model_parallel(backend="gloo")
        ranks = derive_spawn_ranks(
            world_rank=0, tp_size=1, ep_join_rank_offset=0, attn_cp_size=1, attn_tp_size=1, moe_dp_size=1, moe_ep_size=1
        )
        get_parallel().override_permanently(**ranks, attn_tp_rank=0, attn_dp_rank=0)
        _STARTED.append(True)
    return args


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's weight as SGLang multiplies with it, [out, in] in float32."""
    # column-parallel layers split the output (output_size_per_partition), row-parallel ones the input
    rows = getattr(layer, "output_size_per_partition", None) or layer.output_size
    cols = getattr(layer, "input_size_per_partition", None) or layer.input_size
    config = getattr(getattr(layer, "quant_method", None), "quant_config", None)
    return dequantized_layer(layer, rows, cols, getattr(config, "weight_block_size", None))


def load(folder: Path) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    args = server_args(folder)
    model = get_model(
        model_config=ModelConfig.from_server_args(args),
        load_config=LoadConfig(load_format="safetensors"),
        device_config=DeviceConfig("cpu"),
    )
    layers = {
        name: m
        for name, m in model.named_modules()
        if (hasattr(m, "weight_scale") or hasattr(m, "weight_scale_inv")) and getattr(m, "weight", None) is not None
    }
    weights = {name: dequantized(m).contiguous() for name, m in layers.items()}
    plain = {  # unquantized linear layers (`convert --to bf16`, `--dequantize`), as loaded
        name: m.weight.float().contiguous()
        for name, m in model.named_modules()
        if name not in layers
        and name != "lm_head"
        and hasattr(m, "input_size")  # SGLang's LinearBase
        and hasattr(m, "output_size")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and not name.endswith("embed_tokens")
    }
    weights.update(plain)
    weights.update({f"{name}::scale": scale_of(m).float().reshape(-1).contiguous() for name, m in layers.items()})
    head = getattr(model, "lm_head", None)
    if isinstance(getattr(head, "weight", None), torch.Tensor):
        weights["lm_head"] = head.weight.float().contiguous()
    return {"loaded": True, "model_class": type(model).__name__, "unreadable": []}, weights


if __name__ == "__main__":
    run(load)
