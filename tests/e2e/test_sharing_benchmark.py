"""benchmarks/sharing.py --quick runs and shows what sharing saves."""
import json
import subprocess
import sys
from pathlib import Path

from benchmark_modules import SUBPROCESS_TIMEOUT_S

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sharing.py"


def test_sharing_benchmark_quick(tmp_path):
    out = tmp_path / "sharing.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["workload"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    cached, plain = rows[("system prompt", "prefix cache")], rows[("system prompt", "no sharing")]
    assert cached["prompt_tokens_computed"] < plain["prompt_tokens_computed"]
    assert cached["peak_kv_pages"] < plain["peak_kv_pages"]
    for n in (4, 8):
        fork, separate = rows[(f"n={n}", "copy-on-write fork")], rows[(f"n={n}", "separate requests")]
        assert fork["peak_kv_pages"] < separate["peak_kv_pages"]
        assert fork["output_tokens"] == separate["output_tokens"] == 16 * n
