"""Shared bits of the benchmark scripts: machine description, JSON output, table printing."""
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# The H200's measured device-to-device copy rate (../shared/ENVIRONMENT.md), the roofline's bandwidth.
COPY_BANDWIDTH = 4.24e12


def bandwidth_columns(bytes_read: float, seconds: float, prefix: str) -> dict[str, float | None]:
    """`{prefix}_tb_s` (bytes read / time) and `{prefix}_pct_copy_bw` (of COPY_BANDWIDTH); None without time."""
    if seconds <= 0:
        return {f"{prefix}_tb_s": None, f"{prefix}_pct_copy_bw": None}
    bandwidth = bytes_read / seconds
    return {f"{prefix}_tb_s": bandwidth / 1e12, f"{prefix}_pct_copy_bw": 100 * bandwidth / COPY_BANDWIDTH}


def machine() -> str:
    import torch       # here, so the simulator scripts that share this module stay torch-free

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    logging.getLogger("benchmarks").info("wrote %s", path)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A bare JSON list of rows (the format simulate.py's issue prescribes), without write_json's envelope."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")
    logging.getLogger("benchmarks").info("wrote %s", path)


def print_table(rows: list[dict[str, Any]]) -> None:
    """One right-aligned table; floats get 3 decimals below 10 and 1 above, None prints as "-"."""
    if not rows:
        return
    widths = {k: max(len(k), *(len(_fmt(r[k])) for r in rows)) for k in rows[0]}
    header = "  ".join(k.rjust(w) for k, w in widths.items())
    body = ["  ".join(_fmt(r[k]).rjust(w) for k, w in widths.items()) for r in rows]
    print("\n".join([header, "-" * len(header), *body]))  # noqa: T201 - the table is the script's output


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend, or None (with a warning) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("benchmarks").warning("matplotlib is not installed (pip install -e '.[dev]'): no plot")
        return None
    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt
    plt.close(fig)
    logging.getLogger("benchmarks").info("wrote %s", path)
