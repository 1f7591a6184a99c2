"""Peak bytes on disk under a folder while something runs: the streaming tests' and scripts/bench_stream.py's
witness of `--max-disk`."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class disk_sampler:  # noqa: N801 (a statement: `with disk_sampler(folder) as samples:`)
    """Bytes on disk under `folder` (st_blocks: a sparse file counts what it holds), every 2 ms."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.samples, self.stop = folder, [0], threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            used = 0
            for root, _, names in os.walk(self.folder):
                for name in names:
                    try:
                        used += os.lstat(os.path.join(root, name)).st_blocks * 512
                    except FileNotFoundError:
                        pass
            self.samples.append(used)
            time.sleep(0.002)

    def __enter__(self) -> list[int]:
        self.thread.start()
        return self.samples

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
