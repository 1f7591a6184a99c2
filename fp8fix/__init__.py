"""fp8fix: fix FP8 checkpoints that runtimes load wrongly or not at all."""

__version__ = "0.1.0"
