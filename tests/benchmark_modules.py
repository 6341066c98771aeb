"""What the tests that run benchmark scripts share: where the scripts are, a script loaded as a module
(benchmarks/ is not a package), one generous subprocess timeout, and a script run as a subprocess."""
import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, name: str) -> ModuleType:
    """benchmarks/<script> (a path under benchmarks/, such as "soak.py") loaded as module `name`, registered in
    sys.modules (dataclasses look their module up by name). benchmarks/ goes on the path's end, as the scripts
    import their siblings (common, workloads) when run from there."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

# A guard against a hung benchmark, not a speed check: a loaded 2-core machine must never reach it.
SUBPROCESS_TIMEOUT_S = 1800


def side_by_side_env() -> dict[str, str]:
    """torch on one thread (two processes' pools spinning against each other slow a 2-core machine down), and
    the Triton kernels compiled as on any machine rather than interpreted."""
    environ = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return {"OMP_NUM_THREADS": "1", **environ}


def run_benchmark(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """benchmarks/<script> run with `args` in `cwd`, under side_by_side_env; it must succeed."""
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, env=side_by_side_env(), cwd=cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def project_modules_on_import(script_module: str) -> list[str]:
    """The modules of slora, of the benchmarks' library (common, workloads) and of torch that importing
    benchmarks/<script_module>.py loads, in a fresh interpreter: a script's vLLM mode must load none."""
    code = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import {script_module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('slora', 'common', 'workloads', 'torch')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=side_by_side_env())
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout)
