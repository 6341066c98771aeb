"""Settings of the HTTP service, validated once at construction."""
import ipaddress
from dataclasses import dataclass
from pathlib import Path

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    tenants_file: str | None = None           # TOML; None = single-user mode (no keys)
    adapter_root: str | None = None           # folder that path loads must stay inside
    upload_dir: str | None = None             # where uploaded adapters are kept; default: a temporary folder
    allow_unauthenticated: bool = False       # single-user mode on a non-loopback address
    max_n: int = 16                           # samples per prompt
    max_choices: int = 64                     # prompts x n per request
    max_tokens_limit: int | None = None       # default: the model's context
    max_stop_sequences: int = 4
    max_stop_length: int = 256
    max_body_bytes: int = 4 * 2 ** 20         # JSON bodies
    max_upload_bytes: int = 2 * 2 ** 30       # adapter uploads
    max_pending_requests: int = 1024          # whole server: requests in the engine plus queued ones
    retry_after_s: int = 1
    tokenizer_workers: int = 2                # threads tokenizing prompts, each with its own tokenizer copy
    max_tokenize_pending: int = 64            # requests waiting for a tokenizer thread (half per tenant); beyond, 429
    max_prompt_chars: int = 1_000_000         # characters of text in one request (prompts or messages)
    shutdown_timeout_s: float = 30.0          # in-flight requests get this long to finish on SIGTERM
    stall_timeout_s: float = 120.0            # /health fails when one engine step takes longer
    max_adapter_bytes: int | None = None      # uploaded adapter bytes per tenant unless its own limit says otherwise
    timeout_keep_alive_s: float = 5.0         # an idle connection is closed this long after its last response
    timeout_header_s: float = 10.0            # a client has this long to send a request's headers
    timeout_body_idle_s: float = 30.0         # the longest pause allowed while a client sends a request body
    max_connections: int = 1000               # open connections served; requests on more get 503
    metrics_require_key: bool = False         # /metrics answers only with an admin tenant's key

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tenants_file is not None and not Path(self.tenants_file).is_file():
            raise ValueError(f"tenants file not found: {self.tenants_file}")
        if self.adapter_root is not None and not Path(self.adapter_root).is_dir():
            raise ValueError(f"adapter root is not a folder: {self.adapter_root}")
        if self.tenants_file is None and not self.allow_unauthenticated and not is_loopback(self.host):
            # Without tenants there are no keys: anyone who can reach the port could load adapters.
            raise ValueError(f"refusing to serve without a tenants file on {self.host}, which is not a loopback "
                             "address; give --tenants FILE or --allow-unauthenticated")
        for name in ("max_n", "max_choices", "max_stop_sequences", "max_stop_length", "max_body_bytes",
                     "max_upload_bytes", "max_pending_requests", "retry_after_s", "tokenizer_workers",
                     "max_tokenize_pending", "max_prompt_chars", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_tokens_limit", "max_adapter_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_timeout_s < 0 or self.stall_timeout_s <= 0:
            raise ValueError("shutdown_timeout_s must be >= 0 and stall_timeout_s > 0")
        for name in ("timeout_keep_alive_s", "timeout_header_s", "timeout_body_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.metrics_require_key and self.tenants_file is None:
            raise ValueError("metrics_require_key needs a tenants file: without one there are no keys")

    @property
    def single_user(self) -> bool:
        return self.tenants_file is None
