"""Loads helpers.py as the module `kernel_helpers`: test folders have no __init__.py, so a plain
`import helpers` could pick up another folder's helpers.py when the whole suite runs."""
import importlib.util
import sys
from pathlib import Path

if "kernel_helpers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("kernel_helpers", Path(__file__).with_name("helpers.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernel_helpers"] = _module
    _spec.loader.exec_module(_module)
