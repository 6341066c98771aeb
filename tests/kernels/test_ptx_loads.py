"""The LoRA kernels read adapter weights with 16-byte vector loads on sm_90: benchmarks/ptx_loads.py compiles
them for the H100/H200 on this CPU-only machine (Triton's NVIDIA backend needs no GPU to emit PTX) and
counts their global loads by width, and reads their registers from the cubin. With 64-column tiles (ALIGN)
the adapter weights load with vector loads; the default 128-column tiles, whose page is chosen per column,
are compiled too, to show the count tells the two apart."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ptx_loads.py"


def test_align_wide_tiles_read_adapter_weights_with_vector_loads(tmp_path):
    out = tmp_path / "ptx_loads.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["kernel"], row["tile"]): row for row in json.loads(out.read_text())["rows"]}
    assert {kernel for kernel, _ in rows} == {"shrink", "expand", "fused"}
    for kernel in ("shrink", "expand", "fused"):
        vector, gathered = rows[kernel, 64], rows[kernel, 128]
        # Every load of the 64-column variant is wider than one element; its adapter tiles are v4 loads.
        assert vector["b16"] == 0 and vector["v4_b32"] >= 2, vector
        assert gathered["b16"] >= 16, gathered     # a 16 x 128 bf16 tile over 128 threads: 16 elements each
        # Registers from the cubin, and what they leave room for on one multiprocessor (65,536 registers).
        assert 16 <= vector["registers"] <= 255 and vector["shared_bytes"] > 0
        assert 1 <= vector["programs_per_sm"] <= 65536 // (vector["registers"] * 32 * 4) + 1
