"""benchmarks/replicas.py's quick run, on the package's Ray cluster (a cluster of its own would add a Ray start to
the suite): both routings serve the whole trace, and affinity takes adapters on in fewer places."""
import json
import subprocess
import sys

import pytest
from benchmark_modules import BENCHMARKS, SUBPROCESS_TIMEOUT_S

pytest.importorskip("ray")        # a guard only: `make test` installs the ray extra


def test_quick_run_prints_its_table_and_writes_its_json(cluster, tmp_path):
    out = tmp_path / "replicas.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "replicas.py"), "--quick", "--ray-address", cluster,
                           "--out", str(out)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "gen_tok_s" in done.stdout and "load_ratio" in done.stdout
    data = json.loads(out.read_text())
    rows = {row["mode"]: row for row in data["rows"]}
    assert set(rows) == {"affinity", "load"} and rows["affinity"]["replicas"] == rows["load"]["replicas"] == 2
    adapters = data["args"]["adapters"]
    # Affinity takes adapters on in fewer places than routing by load (a burst of first requests for a new
    # adapter may still reach both replicas before Ray's router knows where it went).
    assert 0 < rows["affinity"]["registrations"] <= rows["load"]["registrations"] <= 2 * adapters
    assert all(row["gen_tok_s"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"] > 0 for row in rows.values())
    assert data["summary"]["load_ratio"] == rows["load"]["pool_loads"] / rows["affinity"]["pool_loads"]
