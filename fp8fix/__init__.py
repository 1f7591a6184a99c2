"""fp8fix: fix FP8 checkpoints that runtimes load wrongly or not at all.

The Python API (docs/python-api.md): `convert`, `inspect`, `verify`, `push`, `architectures`
and `architecture_template`, their result types and the errors they raise. The names load on
first use, so `import fp8fix` (and the CLI's start-up) stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: Not `typing.TYPE_CHECKING`: importing typing takes milliseconds of the CLI's start-up, before its Ctrl-C
#: guard is in place (fp8fix.entry); type checkers treat any `TYPE_CHECKING` as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from fp8fix.api import (
        Architecture,
        Fp8fixError,
        HubError,
        InvalidCheckpoint,
        OutputBusy,
        PushResult,
        RegistryEntryError,
        SourceChanged,
        UnsupportedCheckpoint,
        UsageError,
        VerificationFailed,
        architecture_template,
        architectures,
        convert,
        convert_to_hub,
        inspect,
        push,
        verify,
    )
    from fp8fix.inspection import Report as InspectReport
    from fp8fix.registry.architectures import Registry
    from fp8fix.report.convert_report import ConvertResult
    from fp8fix.streaming import StreamResult
    from fp8fix.verification import VerifyReport

__all__ = [
    "__version__",
    "convert",
    "convert_to_hub",
    "inspect",
    "verify",
    "push",
    "architectures",
    "architecture_template",
    "Architecture",
    "PushResult",
    "ConvertResult",
    "StreamResult",
    "InspectReport",
    "VerifyReport",
    "Registry",
    "Fp8fixError",
    "UsageError",
    "InvalidCheckpoint",
    "UnsupportedCheckpoint",
    "VerificationFailed",
    "HubError",
    "OutputBusy",
    "SourceChanged",
    "RegistryEntryError",
]


#: Where the public names that `fp8fix.api` does not define (or re-export) live: (module, attribute).
_ELSEWHERE = {
    "ConvertResult": ("fp8fix.report.convert_report", "ConvertResult"),
    "StreamResult": ("fp8fix.streaming", "StreamResult"),
    "InspectReport": ("fp8fix.inspection", "Report"),
    "VerifyReport": ("fp8fix.verification", "VerifyReport"),
    "Registry": ("fp8fix.registry.architectures", "Registry"),
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'fp8fix' has no attribute {name!r}")
    import importlib

    module, attribute = _ELSEWHERE.get(name, ("fp8fix.api", name))
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
