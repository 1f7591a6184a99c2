"""The converted repo's model card: what it came from, how it was converted, what changed.

Written with huggingface_hub's ModelCard so the metadata block is what the Hub
parses. The source card's content is kept below the conversion section.
"""

from __future__ import annotations

from pathlib import Path

from fp8fix import __version__
from fp8fix.plan import ConversionPlan
from fp8fix.summary import loader_table, module_groups

CARD = "README.md"
TAGS = ["fp8", "fp8fix"]


def conversion_section(plan: ConversionPlan, source_name: str, options: str, config_edits: list[str]) -> str:
    lines = [
        "## FP8 conversion by fp8fix",
        "",
        f"Converted from `{source_name}` with fp8fix {__version__} (`fp8fix convert {options}`).",
        "",
        f"- Architecture: {plan.architecture}",
        f"- Format: {plan.format.label}",
        f"- Layout: **{plan.layout}**",
        "",
    ]
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
    lines += ["Loaders for this layout:", "", "| loader | loads | why |", "|---|---|---|"]
    for name, row in loader_table(plan.layout).items():
        lines.append(f"| {name} | {'yes' if row['loads'] else 'no'} | {row['reason']} |")
    lines.append("")
    return "\n".join(lines)


def write_card(
    source: Path, out_dir: Path, plan: ConversionPlan, source_name: str, options: str, config_edits: list[str]
) -> None:
    from huggingface_hub import ModelCard, ModelCardData

    original = source / CARD
    if original.is_file():
        card = ModelCard.load(original)
        data, body = card.data, card.text.strip()
    else:
        data, body = ModelCardData(), ""
    data.tags = list(dict.fromkeys([*(data.tags or []), *TAGS]))
    text = conversion_section(plan, source_name, options, config_edits)
    if body:
        text += "\n## Original model card\n\n" + body + "\n"
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}").save(out_dir / CARD)
