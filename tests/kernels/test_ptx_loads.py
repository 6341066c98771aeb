"""The 64-column LoRA tiles read adapter weights with 16-byte vector loads on sm_90: benchmarks/ptx_loads.py
compiles them for the H100/H200 on this CPU-only machine (Triton's NVIDIA backend needs no GPU to emit PTX) and
counts their global loads by width, and reads their registers from the cubin. With 64-column tiles (ALIGN)
the adapter weights load with vector loads whatever the Triton version; the default 128-column tiles,
whose page is chosen per column, are compiled and counted too."""
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmark_modules import SUBPROCESS_TIMEOUT_S

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ptx_loads.py"


def test_align_wide_tiles_read_adapter_weights_with_vector_loads(tmp_path):
    out = tmp_path / "ptx_loads.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["kernel"], row["tile"]): row for row in json.loads(out.read_text())["rows"]}
    assert {kernel for kernel, _ in rows} == {"shrink", "expand"}
    for kernel in ("shrink", "expand"):
        vector, gathered = rows[kernel, 64], rows[kernel, 128]
        # Every load of the 64-column variant is wider than one element; its adapter tiles are v4 loads.
        # (What the 128-column variant compiles to depends on the Triton version: 2-byte loads in 3.9,
        # 16-byte loads in 3.6; not asserted.)
        assert vector["b16"] == 0 and vector["v4_b32"] >= 2, vector
        assert sum(gathered[width] for width in ("b16", "v4_b32", "other")) > 0, gathered
        # Registers from the cubin, and what they leave room for on one multiprocessor (65,536 registers).
        assert 16 <= vector["registers"] <= 255 and vector["shared_bytes"] > 0
        assert 1 <= vector["programs_per_sm"] <= 65536 // (vector["registers"] * 32 * 4) + 1
