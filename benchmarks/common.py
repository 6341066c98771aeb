"""Shared bits of the benchmark scripts: machine description, JSON output, table printing."""
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    logging.getLogger("benchmarks").info("wrote %s", path)


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    body = ["  ".join(_fmt(r[c]).rjust(w) for c, w in zip(columns, widths)) for r in rows]
    print("\n".join([line, "-" * len(line), *body]))  # noqa: T201 - the table is the script's output


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)
