"""`inspect --tp` against vLLM 0.32's own code (issue 17): for every FP8 module of the shrunk reported
cases (tests/test_parallel.py) at every TP size from 1 to 64, vLLM's block-shape functions are called
with the module's share, and fp8fix's report must say what they did: nothing when they pass, the
refined block when they refine, their exact message when they refuse.

The modules' roles here are the test's own reading of vLLM's model code (MergedColumnParallelLinear
gate_up, RowParallelLinear down / o_proj, ColumnParallelLinear for MLA's q_b / kv_b, FusedMoE experts),
not fp8fix's table.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import run_cli
from tests.loaders.conftest import HERE, interpreter
from tests.test_parallel import CASES

pytestmark = pytest.mark.loaders

SIZES = (1, 2, 4, 8, 16, 32, 64)


def roles(folder: Path) -> list[dict]:
    """Each FP8 module with its role, split dimension, the other dimension and (experts) hidden size."""
    out = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if not name.endswith(".weight") or "F8" not in str(f.get_slice(name).get_dtype()):
                    continue
                module = name.removesuffix(".weight")
                rows, cols = f.get_slice(name).get_shape()
                if re.search(r"experts\.\d+\.", module):
                    down = module.endswith("down_proj")
                    out.append(
                        {
                            "module": module,
                            "role": "fused-moe",
                            "size": cols if down else rows,
                            "other": rows if down else cols,
                            "hidden": rows if down else cols,
                        }
                    )
                elif module.endswith(("down_proj", "o_proj")):
                    out.append({"module": module, "role": "row-parallel", "size": cols, "other": rows})
                elif module.endswith(("q_b_proj", "kv_b_proj")):
                    out.append({"module": module, "role": "column-parallel", "size": rows, "other": cols})
                elif module.endswith(("gate_proj", "up_proj")):
                    out.append({"module": module, "role": "merged-column", "size": rows, "other": cols})
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_tp_says_what_vllm_does(tmp_path: Path, case: str) -> None:
    build, _ = CASES[case]
    src = build(tmp_path / "src")
    report = json.loads(run_cli("inspect", src, "--tp", ",".join(map(str, SIZES)), "--json").output)["tensor_parallel"]
    said = {}
    for tp, entry in report["sizes"].items():
        for group in entry["modules"]:
            said[(group["role"], group["size"], int(tp))] = group
    heads = json.loads((src / "config.json").read_text()).get("num_attention_heads", 1)
    for tp in SIZES:  # attention whose heads do not split never reaches these functions (test_tp_load.py)
        for m in roles(src):
            if m["module"].endswith("o_proj") and heads % tp:
                claim = said[(m["role"], m["size"], tp)]
                assert claim["behaviour"] == "refuses" and f"does not split {tp} ways" in claim["message"]
    cases = [
        {**m, "tp": tp, "block": report["block"]}
        for m in roles(src)
        for tp in SIZES
        if m["size"] % tp == 0  # shares that do not split evenly never reach these functions
        and not (m["module"].endswith("o_proj") and heads % tp)
    ]
    assert cases
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [interpreter("vllm"), str(HERE / "vllm_tp_check.py"), str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for c, real in zip(cases, json.loads(proc.stdout.splitlines()[-1]), strict=True):
        claim = said.get((c["role"], c["size"], c["tp"]))
        where = f"{c['module']} at TP {c['tp']}"
        if real["raises"]:
            assert claim is not None and claim["behaviour"] == "refuses", where
            assert claim["message"] == real["message"], where
        elif real["refined"]:
            assert claim is not None and claim["behaviour"] == "refines", where
            assert f"to {real['refined'][0]}x{real['refined'][1]}" in claim["message"], where
        else:
            assert claim is None or claim["behaviour"] == "skips-check", where
        if claim is None:
            assert c["tp"] in report["clean_sizes"] or any(k[2] == c["tp"] for k in said), (
                where
            )  # a size with no claim about any module is a clean size
