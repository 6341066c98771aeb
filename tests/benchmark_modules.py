"""What the tests that run benchmark scripts share: where the scripts are, a script loaded as a module
(benchmarks/ is not a package), and one generous subprocess timeout."""
import importlib.util
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
