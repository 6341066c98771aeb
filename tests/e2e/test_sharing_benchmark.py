"""benchmarks/sharing.py --quick runs and shows what sharing saves. (The session's one quick run of it, which
test_benchmarks_quick.py checks too.)"""
import json


def test_sharing_benchmark_quick(quick_benchmark):
    done, out = quick_benchmark("sharing.py")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["workload"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    cached, plain = rows[("system prompt", "prefix cache")], rows[("system prompt", "no sharing")]
    assert cached["prompt_tokens_computed"] < plain["prompt_tokens_computed"]
    assert cached["peak_kv_pages"] < plain["peak_kv_pages"]
    for n in (4, 8):
        fork, separate = rows[(f"n={n}", "copy-on-write fork")], rows[(f"n={n}", "separate requests")]
        assert fork["peak_kv_pages"] < separate["peak_kv_pages"]
        assert fork["output_tokens"] == separate["output_tokens"] == 16 * n
