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
from fp8fix.io.checkpoint import CARD
from fp8fix.plan.pieces import ConversionPlan
from fp8fix.report.convert_report import VLLM_FNUZ_NOTE, encoding_line, module_groups, padding_lines

TAGS = ["fp8", "fp8fix"]
#: huggingface_hub.repocard.REGEX_YAML_BLOCK
FRONT_MATTER = re.compile(r"^(\s*---[\r\n]+)([\S\s]*?)([\r\n]+---(\r\n|\n|$))")
#: The card's sentence naming what was converted and how; `commit_message` reads it back.
CONVERTED = "Converted from `{source}` with fp8fix {version} (`fp8fix convert {options}`)."
CONVERTED_PATTERN = re.compile(r"Converted from `([^`]*)` with fp8fix \S+ \(`fp8fix convert ([^`]*)`\)")


def split_card(text: str) -> tuple[dict[str, Any], str, str | None]:
    """(metadata, body, problem) of a model card, as huggingface_hub's ModelCard reads it.

    Front matter that is not a YAML mapping with string keys gives no metadata and a
    `problem` to warn about: the card's text is still kept.
    """
    import yaml

    match = FRONT_MATTER.search(text)
    if not match:
        return {}, text, None
    body = text[match.end() :]
    try:
        metadata = yaml.safe_load(match.group(2)) or {}
    except yaml.YAMLError as e:
        return {}, body, f"its front matter is not valid YAML ({str(e).splitlines()[0]})"
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        return {}, body, "its front matter is not a mapping with string keys"
    return metadata, body, None


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


def conversion_section(
    plan: ConversionPlan, source_name: str, options: str, config_edits: list[str], verified: str | None = None
) -> str:
    lines = [
        "## FP8 conversion by fp8fix",
        "",
        CONVERTED.format(source=source_name, version=__version__, options=options),
        "",
        f"- Architecture: {plan.architecture}",
        f"- Format: {plan.format.label}",
        f"- Layout: **{plan.layout}**",
        "",
    ]
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
    else:
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
    source: Path,
    out_dir: Path,
    plan: ConversionPlan,
    source_name: str,
    options: str,
    config_edits: list[str],
    verified: str | None = None,
    base_model: str | None = None,
    warnings: list[str] | None = None,
) -> None:
    """Write OUTPUT's card; what could not be kept of SOURCE's card is appended to `warnings`."""
    warnings = [] if warnings is None else warnings
    original = source / CARD
    metadata: dict[str, Any] = {}
    body = ""
    if original.is_file():
        raw = original.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            text = raw.decode("utf-8", errors="replace")
            warnings.append(f"{CARD}: not UTF-8 (byte {e.start}); undecodable bytes were replaced in OUTPUT's card")
        metadata, body, problem = split_card(text)
        if problem:
            warnings.append(f"{CARD}: {problem}; its metadata was dropped, its text is kept")
    metadata = _card_metadata(metadata, warnings)
    if base_model:  # converted from a Hub repo: link it, as the Hub's model tree expects
        metadata = {**metadata, "base_model": base_model, "base_model_relation": "quantized"}
    rocm = ["e4m3fnuz", "rocm"] if plan.encoding and plan.encoding.target == "e4m3fnuz" else []
    metadata["tags"] = list(dict.fromkeys([*_tags(metadata.get("tags")), *TAGS, *rocm]))
    text = conversion_section(plan, source_name, options, config_edits, verified)
    if body.strip():
        text += "\n## Original model card\n\n" + body.strip() + "\n"
    (out_dir / CARD).write_text(f"---\n{metadata_yaml(metadata)}\n---\n\n{text}", encoding="utf-8")


def commit_title(source_name: str, options: str) -> str:
    """The Hub commit title of a conversion: what was converted and how."""
    return f"fp8fix: convert {source_name} ({options.strip()})"


def commit_message(folder: Path) -> str:
    """The commit title for a folder converted earlier (`fp8fix push`), from the card this module wrote."""
    card = folder / CARD
    match = CONVERTED_PATTERN.search(card.read_text(encoding="utf-8", errors="replace")) if card.is_file() else None
    return commit_title(match.group(1), match.group(2)) if match else "fp8fix: upload converted FP8 checkpoint"
