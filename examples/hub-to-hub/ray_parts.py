"""Convert a Hub repo into another with Ray tasks, one per part, then finalize (ray is not an fp8fix
dependency: `pip install ray` where this runs).

    python examples/hub-to-hub/ray_parts.py org/model-FP8 me/model-FP8-fixed --parts 8
"""

from __future__ import annotations

import argparse

import fp8fix


def convert_part(source: str, dest: str, part: int, parts: int, max_disk: int | None = None) -> list[str]:
    """One part: its share of the output shards, uploaded to DEST's pull request; the shards it wrote."""
    return fp8fix.convert_to_hub(source, dest, part=(part, parts), max_disk=max_disk).converted


def finalize(source: str, dest: str) -> str:
    """After every part: the final commit and the merge; the URL of DEST."""
    return fp8fix.convert_to_hub(source, dest, finalize=True).url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("dest")
    parser.add_argument("--parts", type=int, default=8)
    args = parser.parse_args()
    import ray

    task = ray.remote(num_cpus=2)(convert_part)
    ray.get([task.remote(args.source, args.dest, k, args.parts) for k in range(1, args.parts + 1)])
    print(finalize(args.source, args.dest))


if __name__ == "__main__":
    main()
