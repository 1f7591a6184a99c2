"""torch for the one float path that needs it, or one line saying how to install it.

Conversions are byte maps and numpy, and verify checks fp8fix's own output the same way; only
rows no byte map explains (another tool's rounding, block rows requantized to a merged scale)
are dequantized with torch, whose float -> fp8 cast is the independent reference there. torch
is an extra, `fp8fix[torch]`, because the package index's default torch is the multi-GB CUDA
build and nothing else needs it.
"""

from __future__ import annotations

from types import ModuleType

from fp8fix.errors import MissingExtra

#: What to install, said once here for every message.
INSTALL = "pip install 'fp8fix[torch]' (a CPU build is enough: pip install torch --index-url https://download.pytorch.org/whl/cpu)"


def import_torch(purpose: str) -> ModuleType:
    """The torch module; MissingExtra naming `purpose` and the extra when it is not installed."""
    try:
        import torch
    except ImportError:
        raise MissingExtra(f"{purpose} needs torch, which is not installed: {INSTALL}") from None
    return torch
