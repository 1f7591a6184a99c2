"""The model card's loader table against what fp8fix's rules say of OUTPUT as it is (what `inspect OUTPUT`
prints).

verify's own checks never use the verdict rules: it is the witness of a conversion, and a rule convert used
must not vouch for itself (`fp8fix/verification/`). The card's table is a claim about OUTPUT that only those
rules can check, so `verify` checks it after its own checks, from OUTPUT's files (not from convert's plan): a
row edited by hand, or a card copied from another conversion, is a difference of the card's facts.
"""

from __future__ import annotations

from pathlib import Path

from fp8fix.errors import InvalidCheckpoint, some
from fp8fix.io.checkpoint import CARD, open_checkpoint
from fp8fix.io.source_tree import read_regular
from fp8fix.model import describe_checkpoint
from fp8fix.registry.architectures import Registry
from fp8fix.verdicts import loader_verdicts
from fp8fix.verification.card import MAX_CARD_BYTES, fp8fix_section
from fp8fix.verification.report import METADATA, VerifyReport

TABLE_HEADING = "Loaders for this checkpoint:"


def check_card_verdicts(report: VerifyReport, output: Path, registry: Registry) -> None:
    """Each row of the card's loader table must be `| loader | verdict | why |` as the rules give it for OUTPUT."""
    try:
        text = read_regular(output / CARD, MAX_CARD_BYTES, follow_links=False).decode("utf-8", errors="replace")
        expected = loader_verdicts(describe_checkpoint(open_checkpoint(output, "OUTPUT"), registry))
    except (OSError, InvalidCheckpoint):
        return  # no card, or no checkpoint: verify's own checks said so
    section = fp8fix_section(text)
    if TABLE_HEADING not in section:
        report.problem(f"{CARD}: no loader table ('{TABLE_HEADING}')", METADATA, edit=True)
        return
    rows = {}
    for line in section.split(TABLE_HEADING, 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 3 and cells[0] not in ("loader", "---"):
            rows[cells[0]] = cells
    for name, v in expected.items():
        said = rows.pop(name, None)
        if said is None:
            report.problem(f"{CARD}: its loader table has no row for {name}", METADATA, edit=True)
        elif said[1] != v.verdict or " | ".join(said[2:]) != v.reason:
            report.problem(  # the card's cells are any text (a hostile card's megabytes): shown cut
                f"{CARD}: its loader table says {name}: {said[1]:.40}; for OUTPUT as it is the rules say {v.verdict} "
                f"({v.reason[:80]})",
                METADATA,
                edit=True,
            )
    if rows:
        report.problem(
            f"{CARD}: its loader table has rows for {some(list(rows))}, loaders fp8fix does not judge",
            METADATA,
            edit=True,
        )
