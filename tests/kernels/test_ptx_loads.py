"""The LoRA kernels read adapter weights with 16-byte vector loads on sm_90: benchmarks/ptx_loads.py compiles
them for the H100/H200 on this CPU-only machine (Triton's NVIDIA backend needs no GPU to emit PTX) and
counts their global loads by width, and reads their registers from the cubin. The gathered variant is
compiled too, to show the count tells the two apart."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ptx_loads.py"


def test_adapter_weights_are_read_with_vector_loads(tmp_path):
    out = tmp_path / "ptx_loads.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["kernel"], row["page_loads"]): row for row in json.loads(out.read_text())["rows"]}
    assert {kernel for kernel, _ in rows} == {"shrink", "expand", "fused"}
    for kernel in ("shrink", "expand", "fused"):
        split, gathered = rows[kernel, "split"], rows[kernel, "gathered"]
        assert split["b16"] == 0 and split["v4_b32"] > gathered["v4_b32"], split
        assert gathered["b16"] >= 16, gathered     # a 16 x 128 bf16 tile over 128 threads: 16 elements each
        # Registers from the cubin, and what they leave room for on one multiprocessor (65,536 registers).
        assert 16 <= split["registers"] <= 255 and split["shared_bytes"] > 0
        assert 1 <= split["programs_per_sm"] <= 65536 // (split["registers"] * 32 * 4) + 1
