"""Starting `slora serve` processes in tests: a free loopback port, a tenants file, waiting for /health."""
import socket
import subprocess
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 600   # a loaded 2-core machine loads the model slowly; only a hang reaches it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_tenants(folder: Path, tenants: dict[str, dict]) -> Path:
    """A tenants TOML in `folder`: {tenant: {"key": API key or list of keys, other fields as they are}}."""
    from slora.api.tenants import hash_key
    blocks = []
    for name, fields in tenants.items():
        keys = fields["key"] if isinstance(fields["key"], list) else [fields["key"]]
        lines = [f"[tenants.{name}]", f"key_sha256 = {[hash_key(k) for k in keys]!r}".replace("'", '"')]
        lines += [f"{field} = {value!r}".replace("'", '"') for field, value in fields.items() if field != "key"]
        blocks.append("\n".join(lines))
    path = folder / "tenants.toml"
    path.write_text("\n\n".join(blocks) + "\n")
    return path


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll `url`/health until it answers 200; RuntimeError with the log's end if the process exits first or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server did not become healthy:\n{log_path.read_text()[-4000:]}")
