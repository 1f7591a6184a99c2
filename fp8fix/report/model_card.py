"""The converted repo's model card: what it came from, how it was converted, what changed.

SOURCE's metadata is normalized by huggingface_hub's `ModelCardData` and the block is
rendered as its `to_yaml` renders it, so it is what the Hub parses. The source card's
content is kept below the conversion section. The card is split with the Hub's own
front-matter rule here rather than through `ModelCard`, whose module costs a quarter of
a second to import on every conversion.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fp8fix import __version__
from fp8fix.errors import Fp8fixError
from fp8fix.io.checkpoint import CARD
from fp8fix.io.source_tree import read_regular
from fp8fix.numerics.dtypes import is_fp8
from fp8fix.plan.pieces import ConversionPlan
from fp8fix.registry.formats import COMPRESSED_TENSORS
from fp8fix.report.convert_report import (
    VLLM_FNUZ_NOTE,
    dequantized_lines,
    encoding_line,
    module_groups,
    padding_lines,
    reblocked_lines,
    shared_fp4_lines,
    ue8m0_lines,
)

TAGS = ["fp8", "fp8fix"]
#: The card's sentence naming what was converted and how; `commit_message` reads it back.
CONVERTED = "Converted from `{source}` with fp8fix {version} (`fp8fix convert {options}`)."
CONVERTED_PATTERN = re.compile(r"Converted from `([^`]*)` with fp8fix \S+ \(`fp8fix convert ([^`]*)`\)")
#: A model card is kilobytes; a larger README.md is not kept (with a warning).
MAX_CARD_BYTES = 16 * 1024 * 1024
#: YAML nodes the front matter may expand to (aliases counted each time they are used) and how deep
#: it may nest: a real card has hundreds of nodes a few levels deep; an alias bomb has billions.
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64
_NEWLINES = "\r\n"


def front_matter(text: str) -> tuple[str, int] | None:
    """(the YAML block, where the body starts) of a card, as huggingface_hub's front-matter regex
    `^(\\s*---[\\r\\n]+)([\\S\\s]*?)([\\r\\n]+---(\\r\\n|\\n|$))` finds them, or None.

    A linear scan: the Hub's regex backtracks cubically on runs of newlines (`---` and 5,000
    newlines took over 30 s). tests/test_model_card.py checks both agree on every short string.
    """
    start = len(text) - len(text.lstrip())
    if not text.startswith("---", start):
        return None
    open_end = start + 3
    run_end = open_end
    while run_end < len(text) and text[run_end] in _NEWLINES:
        run_end += 1
    if run_end == open_end:
        return None
    # the first run of newlines after the opening one that is followed by a closing `---`
    at = text.find("---", run_end + 1)
    while at != -1:
        after = _closing_end(text, at)
        if text[at - 1] in _NEWLINES and after is not None:
            run_start = at
            while text[run_start - 1] in _NEWLINES:
                run_start -= 1
            return text[run_end:run_start], after
        at = text.find("---", at + 1)
    # else the opening run gives its last newline to the closing one: `---`, newlines, `---`, no YAML
    if run_end - open_end >= 2:
        after = _closing_end(text, run_end)
        if text.startswith("---", run_end) and after is not None:
            return "", after
    return None


def _closing_end(text: str, at: int) -> int | None:
    """Where the card's body starts after a `---` at `at` that closes the front matter, or None:
    it must be followed by a newline (`\\r\\n` or `\\n`) or the end (`$`: the end, or a last `\\n`)."""
    end = at + 3
    if text.startswith("\r\n", end):
        return end + 2
    if text.startswith("\n", end):
        return end + 1
    return end if end == len(text) else None


def split_card(text: str) -> tuple[dict[str, Any], str, str | None]:
    """(metadata, body, problem) of a model card, as huggingface_hub's ModelCard reads it.

    Front matter that is not a YAML mapping with string keys, or that is too large or deep
    (`bounded_yaml`), gives no metadata and a `problem` to warn about: the card's text is still kept.
    """
    found = front_matter(text)
    if found is None:
        return {}, text, None
    block, body_start = found
    body = text[body_start:]
    metadata, problem = bounded_yaml(block)
    if problem:
        return {}, body, problem
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        return {}, body, "its front matter is not a mapping with string keys"
    return metadata, body, None


def bounded_yaml(block: str) -> tuple[Any, str | None]:
    """(value, None) of a YAML block read safely, or (None, why not): PyYAML's safe loader, after the
    composed node graph is checked to expand to at most MAX_YAML_NODES nodes MAX_YAML_DEPTH deep
    (aliases count each time they are used, so an alias bomb is refused before it is built)."""
    import yaml

    try:
        loader = yaml.SafeLoader(block)
        try:
            root = loader.get_single_node()
            if root is None:
                return {}, None
            problem = _yaml_too_big(root)
            if problem:
                return None, f"its front matter {problem}"
            return loader.construct_document(root) or {}, None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        return None, f"its front matter is not valid YAML ({str(e).splitlines()[0]})"
    except RecursionError:
        return None, f"its front matter nests more than {MAX_YAML_DEPTH} levels deep"
    except (ValueError, OverflowError) as e:  # an integer of 5,000 digits, a date out of range
        return None, f"its front matter holds a value Python cannot read ({str(e).splitlines()[0][:80]})"


def _yaml_too_big(root: Any) -> str | None:
    """Why a composed YAML graph is too large to build, or None."""
    import yaml

    stack, count = [(root, 1)], 0
    while stack:
        node, level = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            return f"expands to more than {MAX_YAML_NODES} values (YAML aliases)"
        if level > MAX_YAML_DEPTH:
            return f"nests more than {MAX_YAML_DEPTH} levels deep"
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, level + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend((part, level + 1) for pair in node.value for part in pair)
    return None


def _card_metadata(metadata: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """SOURCE's card metadata as huggingface_hub's `ModelCardData` normalizes it (eval results
    into `model-index`, unset fields dropped); metadata it cannot take is dropped, with a warning.

    Imported only for a card that has metadata: the module costs a fifth of fp8fix's start-up.
    """
    if not metadata:
        return {}
    from huggingface_hub.repocard_data import ModelCardData

    try:
        data = ModelCardData(**metadata)
        data.to_yaml()
        normalized: dict[str, Any] = data.to_dict()  # type: ignore[no-untyped-call]
    except Exception as e:  # third-party validation of user data: any failure means "not usable metadata"
        warnings.append(f"{CARD}: its metadata is not a valid model card ({type(e).__name__}); the card's text is kept")
        return {}
    return normalized


def _tags(value: Any) -> list[str]:
    return [str(t) for t in value] if isinstance(value, list) else [value] if isinstance(value, str) else []


def metadata_yaml(metadata: dict[str, Any]) -> str:
    """The card's front matter, rendered as huggingface_hub's `CardData.to_yaml` renders it
    (`yaml.dump`, keys in order, unicode kept: `huggingface_hub.utils._fixes.yaml_dump`)."""
    import yaml

    return str(yaml.dump(metadata, sort_keys=False, allow_unicode=True)).strip()


def format_line(plan: ConversionPlan) -> str:
    """The output's format, and the source's where the conversion changed it."""
    if plan.unquantized:
        return f"{plan.unquantized}, unquantized (dequantized from {plan.format.label})"
    if plan.output_format == "compressed-tensors" and plan.format.name != COMPRESSED_TENSORS.name:
        return f"{COMPRESSED_TENSORS.label} (converted from {plan.format.label})"
    return f"{plan.format.label} (as the source)"


def conversion_section(
    plan: ConversionPlan, source_name: str, options: str, config_edits: list[str], verified: str | None = None
) -> str:
    lines = [
        "## FP8 conversion by fp8fix",
        "",
        CONVERTED.format(source=source_name, version=__version__, options=options),
        "",
        f"- Architecture: {plan.architecture}",
        f"- Format: {format_line(plan)}",
        *([] if plan.unquantized else [f"- Layout: **{plan.layout}**"]),
        "",
    ]
    changes = [*dequantized_lines(plan), *ue8m0_lines(plan), *reblocked_lines(plan), *shared_fp4_lines(plan)]
    lines += [f"- {line[:1].upper()}{line[1:]}" for line in changes]  # (capitalize() would lowercase vLLM, MX)
    encoding = encoding_line(plan)
    if encoding:
        lines += [f"- FP8 {encoding}", "", VLLM_FNUZ_NOTE.replace("note: ", "Note: ", 1), ""]
    tensor_parallel = padding_lines(plan)
    if tensor_parallel:
        lines += ["Tensor parallelism (`--tp`):", "", *(f"- {line.strip()}" for line in tensor_parallel), ""]
    groups = module_groups(plan)
    if groups:
        lines += ["| modules | count | scale | change | why |", "|---|---|---|---|---|"]
        for g in groups:
            into = f" into {', '.join(g['into'])}" if g["into"] else ""
            error = ""
            if g["max_error"] is not None:
                error = f" (max error {g['max_error']:.3g}, {g['max_error_steps']:.2f} fp8 steps)"
            lines.append(
                f"| `{g['modules']}` | {g['count']} | {g['scale']} | {g['action']}{into}{error} | {g['reason']} |"
            )
    elif not plan.dequantized:
        lines.append("No fused modules: every tensor is copied unchanged.")
    lines.append("")
    if config_edits:
        lines += ["config.json changes:", ""] + [f"- {e}" for e in config_edits] + [""]
    if verified:
        lines += [f"Verified with `fp8fix verify`: {verified}.", ""]
    lines += ["Loaders for this checkpoint:", "", "| loader | verdict | why |", "|---|---|---|"]
    for name, v in plan.loaders.items():
        lines.append(f"| {name} | {v.verdict} | {v.reason} |")
    lines.append("")
    return "\n".join(lines)


def write_card(
    source_card: Path | None,
    out_dir: Path,
    plan: ConversionPlan,
    source_name: str,
    options: str,
    config_edits: list[str],
    verified: str | None = None,
    base_model: str | None = None,
    warnings: list[str] | None = None,
) -> None:
    """Write OUTPUT's card, keeping `source_card`'s text (SOURCE's README.md, checked readable: None when
    there is none or it may not be read); what could not be kept of it is appended to `warnings`."""
    warnings = [] if warnings is None else warnings
    metadata: dict[str, Any] = {}
    body = ""
    raw = _card_bytes(source_card, warnings) if source_card is not None else None
    if raw is not None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            text = raw.decode("utf-8", errors="replace")
            warnings.append(f"{CARD}: not UTF-8 (byte {e.start}); undecodable bytes were replaced in OUTPUT's card")
        metadata, body, problem = split_card(text)
        if problem:
            warnings.append(f"{CARD}: {problem}; its metadata was dropped, its text is kept")
    metadata = _card_metadata(metadata, warnings)
    # from the tensors written: `--to bf16`, and `--dequantize` / `--tp-bf16` taking every FP8 module, leave none
    fp8_left = any(is_fp8(t.dtype) for shard in plan.shards for t in shard.tensors)
    if base_model:  # converted from a Hub repo: link it, as the Hub's model tree expects
        metadata = {**metadata, "base_model": base_model}
        if fp8_left:  # a dequantized model is no quantization of its base: the Hub infers none
            metadata["base_model_relation"] = "quantized"
    rocm = ["e4m3fnuz", "rocm"] if plan.encoding and plan.encoding.target == "e4m3fnuz" else []
    tags = [*_tags(metadata.get("tags")), *TAGS, *rocm]
    if not fp8_left:  # no FP8 weight left: the Hub must not list it as one
        tags = [t for t in tags if t != "fp8"] + ([plan.unquantized.lower()] if plan.unquantized else [])
    metadata["tags"] = list(dict.fromkeys(tags))
    text = conversion_section(plan, source_name, options, config_edits, verified)
    if body.strip():
        text += "\n## Original model card\n\n" + body.strip() + "\n"
    (out_dir / CARD).write_text(f"---\n{metadata_yaml(metadata)}\n---\n\n{text}", encoding="utf-8")


def _card_bytes(path: Path, warnings: list[str]) -> bytes | None:
    """SOURCE's card, or None (with a warning) when it is larger than a card can be."""
    size = path.stat().st_size
    if size > MAX_CARD_BYTES:
        warnings.append(f"{CARD}: {size} bytes, more than a model card can be; its text was not kept")
        return None
    return read_regular(path, MAX_CARD_BYTES)


def commit_title(source_name: str, options: str) -> str:
    """The Hub commit title of a conversion: what was converted and how."""
    return f"fp8fix: convert {source_name} ({options.strip()})"


def commit_message(folder: Path) -> str:
    """The commit title for a folder converted earlier (`fp8fix push`), from the card this module wrote."""
    try:
        text = read_regular(folder / CARD, MAX_CARD_BYTES, follow_links=False).decode("utf-8", errors="replace")
    except (OSError, Fp8fixError):  # no card, or none that can be read: the generic title
        text = ""
    match = CONVERTED_PATTERN.search(text)
    return commit_title(match.group(1), match.group(2)) if match else "fp8fix: upload converted FP8 checkpoint"
