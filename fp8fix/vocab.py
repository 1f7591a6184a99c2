"""The words fp8fix's data speaks in, as types mypy checks (and JSON writes as plain strings).

Each vocabulary is a `Literal`, so a misspelt layout, action or scale kind is a type
error, not a silently different branch; the tuples list the values for the CLI.
"""

from __future__ import annotations

from typing import Literal, get_args

#: How a fused module's scales are written (docs/layouts.md).
Layout = Literal["unfused", "per-shard", "fused", "channel"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)

#: What the plan does to one fused module or stacked-experts tensor.
Action = Literal[
    "unfuse", "split-scale", "requantize", "merge-equal-scales", "max-input-scale", "per-channel-scale", "keep"
]

#: How a weight's scale covers it: one value (tensor), one per fused shard, per output row (channel),
#: per rows x columns block, per expert (stacked experts), or not quantized at all (none).
ScaleKind = Literal["tensor", "shard", "channel", "block", "expert", "none"]

#: How inspect describes a weight's scale: a kind, or why there is none to use.
ScaleReport = Literal[ScaleKind, "missing", "unknown"]

#: How a weight's activations are scaled.
InputScaleKind = Literal["static", "static-per-shard", "dynamic"]

#: What verify found for one FP8 weight.
#: `mismatch`: OUTPUT differs from what SOURCE makes it (the record counts the codes that differ).
WeightVerdict = Literal["exact", "rounded", "requantized", "dequantized", "mismatch"]

#: The version of the layout of every `--json` document (and `to_json()` in the Python API): docs/cli-output.md.
#: 2: a loader verdict may be `rounded`, and `loads` means exact (1: e4m3fnuz rounding was `loads-wrong`).
SCHEMA_VERSION = 2

#: `--to` names of the FP8 weight encodings.
Encoding = Literal["e4m3fn", "e4m3fnuz"]
ENCODING_NAMES: tuple[Encoding, ...] = get_args(Encoding)
#: `--to` names of the unquantized dtypes a whole model can be written in (GPUs without FP8).
Precision = Literal["bf16", "float16"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
#: `--scales`: how block scales are stored. ue8m0: powers of two (DeepGEMM on Hopper / Blackwell).
Scales = Literal["ue8m0"]
SCALES: tuple[Scales, ...] = get_args(Scales)
#: `convert --blocks`: the block grid an MXFP8 checkpoint is written at.
Blocks = Literal["128x128", "mx"]
BLOCKS: tuple[Blocks, ...] = get_args(Blocks)
#: Everything `--to` takes: an FP8 encoding or an unquantized dtype.
ConvertTo = Literal["e4m3fn", "e4m3fnuz", "bf16", "float16"]
TO_NAMES: tuple[ConvertTo, ...] = get_args(ConvertTo)

#: How a config list's entries match module names (see `registry.formats.NameList`).
Grammar = Literal["exact", "exact-or-re", "transformers", "fnmatch", "quark-layer"]

#: What a loader does with a checkpoint, graded by loss: loads it with the right weights (`loads`), loads it
#: with some weights rounded by at most half an fp8 step (`rounded`: e4m3fnuz codes cast into e4m3fn), loads it
#: with wrong weights (unscaled codes, random-initialised modules), refuses it, or not judged: what it does was
#: neither run here nor read from its source (a GPU-only quantizer, a model's remote code); the reason says why.
Verdict = Literal["loads", "rounded", "fails", "loads-wrong", "not-judged"]
#: What a loader's call does with a checkpoint's kv-cache scales: an FP8 cache at those scales, or not.
KvVerdict = Literal["used", "ignored", "not-judged"]

#: Which loaders a conversion is for: `auto` picks the output that loads correctly in the most
#: loaders, the current ones (vLLM since 0.19, transformers) first.
Target = Literal["auto", "vllm", "vllm-legacy", "transformers"]
TARGETS: tuple[Target, ...] = get_args(Target)

#: The checkpoint format OUTPUT is written in: the source's, or (from AutoFP8, Quark, ModelOpt) compressed-tensors.
OutputFormat = Literal["keep", "compressed-tensors"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = get_args(OutputFormat)

#: `--jobs` / `jobs=`: a number of processes, or this word: the cores other processes leave idle.
AutoJobs = Literal["auto"]
AUTO_JOBS: AutoJobs = "auto"
