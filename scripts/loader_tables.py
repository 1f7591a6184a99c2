#!/usr/bin/env python3
"""Render docs/loader-rules.md's loader table from the data in fp8fix/registry/loaders.py, with each row's evidence.

    python scripts/loader_tables.py           # rewrite the table between the page's markers
    python scripts/loader_tables.py --check   # exit 1 when the page's table is not what the data says

The table is never written by hand: a rule changes in `registry/loaders.py` (or the facts
in `verdicts.py` it names), and this script carries it into docs/loader-rules.md; the test suite
runs `--check`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp8fix.registry.kv_rules import KV_RULES
from fp8fix.registry.loader_rows import CALLS, LOADERS, WITH_PACKAGE
from fp8fix.registry.loaders import (
    DEFAULT_EVIDENCE,
    LOADS_BECAUSE,
    MX_RULES,
    PLAIN_MODEL,
    PLAIN_MODEL_RULES,
    RULES,
    UNQUANTIZED_EVIDENCE,
)
from fp8fix.verdicts import FACT_DESCRIPTIONS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "loader-rules.md"
START, END = "<!-- loader-rules:start (scripts/loader_tables.py) -->", "<!-- loader-rules:end -->"


def render() -> str:
    lines = ["| loader | the call it models | measured | how it is known |", "|---|---|---|---|"]
    for loader, c in CALLS.items():
        lines.append(f"| {loader} | {c.call} | {'yes' if c.measured else 'no'} | {c.how} |")
    lines += ["", "| loader | when the checkpoint has | verdict | why | evidence |", "|---|---|---|---|---|"]
    for loader in (*LOADERS, *(row for _, row in WITH_PACKAGE.values())):
        plain = ", ".join(
            FACT_DESCRIPTIONS[r.condition] for r in RULES if r.loader == loader and r.condition in PLAIN_MODEL_RULES
        )
        unless = f", unless a rule below on {plain} holds" if plain else ""
        if loader in UNQUANTIZED_EVIDENCE:  # not the rows of an optional package (no plain model needs one)
            lines.append(
                f"| {loader} | {FACT_DESCRIPTIONS['unquantized']} (`convert --to bf16`) | **loads**{unless} "
                f"| {PLAIN_MODEL} | {UNQUANTIZED_EVIDENCE[loader]} |"
            )
        for rule in (r for r in MX_RULES if r.loader == loader):  # an MX checkpoint: these rules only
            what = FACT_DESCRIPTIONS[rule.condition]
            lines.append(f"| {loader} | {what} | **{rule.verdict}**{unless} | {rule.reason} | {rule.evidence} |")
        for rule in (r for r in RULES if r.loader == loader):
            reason = rule.reason.format(
                architecture="the architecture", nearest=" (and the nearest name vLLM registers)", rope="(what misfits)"
            )
            lines.append(
                f"| {loader} | {FACT_DESCRIPTIONS[rule.condition]} | **{rule.verdict}** | {reason} | {rule.evidence} |"
            )
        for layout, why in LOADS_BECAUSE[loader].items():
            lines.append(f"| {loader} | otherwise, {layout} modules | **loads** | {why} | {DEFAULT_EVIDENCE[loader]} |")
        lines.append(
            f"| {loader} | otherwise, no fused modules | **loads** | no fused modules | {DEFAULT_EVIDENCE[loader]} |"
        )
    lines += [
        "",
        "| loader | kv-cache scales, when the checkpoint has | verdict | why | evidence |",
        "|---|---|---|---|---|",
    ]
    for rule in KV_RULES:
        when = FACT_DESCRIPTIONS[rule.condition]
        lines.append(f"| {rule.loader} | {when} | **{rule.verdict}** | {rule.reason} | {rule.evidence} |")
    lines.append(
        "| every loader | kv-cache scales no rule above covers, or a load that fails or is not judged | **not-judged** "
        "| no real load here measured it | the row's default evidence |"
    )
    return "\n".join(lines)


def replaced(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{render()}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = PAGE.read_text(encoding="utf-8")
    new = replaced(text)
    if args.check:
        sys.exit(0 if new == text else 1)
    PAGE.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
