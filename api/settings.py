"""Settings of the HTTP service, validated once at construction."""
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slora.sampling.grammar_service import CompileLimits

LOOPBACK_NAMES = ("localhost",)
TOOL_CALL_PARSERS = ("hermes",)
ADAPTER_STORE_NAME = "adapter-store"     # the default adapter store's folder in the slora cache
MAX_SERVED_NAME_CHARS = 256               # protocol.MAX_NAME_CHARS: a longer `model` is refused anyway
_LORA_MODULE_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True)
class LoraModule:
    """An adapter `slora serve --lora-modules` loads at start, public (owned by no tenant)."""

    name: str
    path: str
    base_model_name: str | None = None    # vLLM's JSON form carries it; accepted, not used (one base model)


def parse_lora_module(text: str) -> LoraModule:
    """One `--lora-modules` item: `name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`.
    ValueError naming the item."""
    shown = text if len(text) <= 200 else text[:200] + "..."
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {shown!r}: not valid JSON ({exc})") from None
        unknown = sorted(set(fields) - _LORA_MODULE_KEYS) if isinstance(fields, dict) else []
        if unknown:
            raise ValueError(f"--lora-modules {shown!r}: unknown key(s) {', '.join(unknown)}; the keys are name, "
                             "path and base_model_name")
        if not isinstance(fields, dict) or not all(isinstance(fields.get(key), str) for key in ("name", "path")):
            raise ValueError(f"--lora-modules {shown!r}: the JSON form needs \"name\" and \"path\" strings")
        base = fields.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {shown!r}: base_model_name must be a string")
        return LoraModule(fields["name"], fields["path"], base)
    name, equals, path = text.partition("=")
    if not equals or not path:
        raise ValueError(f"--lora-modules {shown!r}: give name=path or a JSON object "
                         '{"name": ..., "path": ...}')
    return LoraModule(name, path)


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
    adapter_store: str | None = None          # adapters loaded through the API, kept across restarts;
                                              # default: <slora cache>/adapter-store (ADAPTER_STORE_NAME)
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
    max_connections: int = 1000               # requests in progress at once; beyond, 503 (api/connections.py)
    connection_reserve: int | None = None     # of those, kept for /health and keyed requests; default 10%, >= 1
    max_connections_per_client: int = 64      # idle connections of one client address (its oldest closed beyond)
    min_body_rate: int = 1024                 # bytes/s a request body must keep up after timeout_body_idle_s; 0: off
    metrics_require_key: bool = False         # /metrics answers only with an admin tenant's key
    lora_modules: tuple[LoraModule, ...] = ()  # adapters loaded at start, public; a bad one stops the start
    enable_lora_resolver: bool = False        # a request naming an unloaded adapter loads <adapter_root>/<name>
    served_model_names: tuple[str, ...] = ()  # the base model's names (the first is shown); default: its own
    enable_auto_tool_choice: bool = False     # parse tool calls out of chat answers (with tool_call_parser)
    tool_call_parser: str | None = None       # one of TOOL_CALL_PARSERS
    grammar_compile_timeout_s: float = 5.0    # one structured-output compile (400 beyond)
    grammar_max_bytes: int = 64 * 2 ** 20     # a compiled grammar's size (400 beyond)
    grammar_max_compile_bytes: int = 2 ** 30  # a compile worker's growth while it compiles (400 beyond)
    grammar_cache_bytes: int = 512 * 2 ** 20  # compiled grammars kept, shared fairly among tenants
    grammar_workers: int = 2                  # compile worker processes
    grammar_max_pending: int = 4              # one tenant's compiles queued or running (429 beyond)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tenants_file is not None and not Path(self.tenants_file).is_file():
            raise ValueError(f"tenants file not found: {self.tenants_file}")
        if self.adapter_root is not None and not Path(self.adapter_root).is_dir():
            raise ValueError(f"adapter root is not a folder: {self.adapter_root}")
        if self.adapter_store is not None and (not self.adapter_store or
                                               Path(self.adapter_store).exists() and
                                               not Path(self.adapter_store).is_dir()):
            raise ValueError(f"adapter store is not a folder: {self.adapter_store!r}")
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
        self._check_connection_limits()
        if self.metrics_require_key and self.tenants_file is None:
            raise ValueError("metrics_require_key needs a tenants file: without one there are no keys")
        if self.enable_lora_resolver and self.adapter_root is None:
            raise ValueError("enable_lora_resolver (--enable-lora-resolver) needs an adapter root (--adapter-root "
                             "DIR): it loads <adapter root>/<model name>")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs a tool_call_parser "
                             f"(--tool-call-parser {'|'.join(TOOL_CALL_PARSERS)})")
        self.compile_limits()
        self._check_served_names()
        self._check_lora_modules()

    def compile_limits(self) -> "CompileLimits":
        """The structured-output compile limits, checked by their owner."""
        from slora.sampling.grammar_service import CompileLimits
        return CompileLimits(timeout_s=self.grammar_compile_timeout_s, max_grammar_bytes=self.grammar_max_bytes,
                             max_compile_bytes=self.grammar_max_compile_bytes, cache_bytes=self.grammar_cache_bytes,
                             workers=self.grammar_workers, max_pending_per_tenant=self.grammar_max_pending)

    def _check_connection_limits(self) -> None:
        if self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client must be >= 1, got {self.max_connections_per_client}")
        if self.min_body_rate < 0:
            raise ValueError(f"min_body_rate must be >= 0 (0: not checked), got {self.min_body_rate}")
        if self.connection_reserve is not None and not 0 <= self.connection_reserve < self.max_connections:
            raise ValueError(f"connection_reserve must be in [0, max_connections), got {self.connection_reserve} "
                             f"with max_connections {self.max_connections}")

    @property
    def reserved_connections(self) -> int:
        """Request slots only /health and keyed requests may take: connection_reserve, by default 10% of
        max_connections and at least 1 (none when max_connections is 1)."""
        if self.connection_reserve is not None:
            return self.connection_reserve
        return min(max(1, self.max_connections // 10), self.max_connections - 1)

    def _check_served_names(self) -> None:
        for name in self.served_model_names:
            if not isinstance(name, str) or not 1 <= len(name) <= MAX_SERVED_NAME_CHARS or not name.isprintable():
                raise ValueError(f"served_model_names: {name!r} must be 1 to {MAX_SERVED_NAME_CHARS} printable "
                                 "characters")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError("served_model_names: a name is given twice")

    def _check_lora_modules(self) -> None:
        """Each module's name and path, before the model loads; its files are validated (as PEFT, against the
        model) once the engine is up, by the same code as the admin load route."""
        if not self.lora_modules:
            return
        # Imported here: protocol pulls in pydantic, which `slora generate` need not load.
        from slora.api.protocol import ADAPTER_NAME_PATTERN
        seen: set[str] = set()
        for module in self.lora_modules:
            where = f"--lora-modules {module.name!r}"
            if not re.fullmatch(ADAPTER_NAME_PATTERN, module.name):
                raise ValueError(f"{where}: an adapter name must be 1-128 letters, digits, '.', '_' or '-', "
                                 "starting with a letter or digit")
            if module.name in seen:
                raise ValueError(f"{where}: the name is given twice")
            if module.name in self.served_model_names:
                raise ValueError(f"{where}: the name is one of the base model's served_model_names")
            seen.add(module.name)
            self.lora_module_folder(module)

    def lora_module_folder(self, module: LoraModule) -> Path:
        """The folder of a --lora-modules adapter: with an adapter root, inside it (the admin route's check:
        no '..', no symbolic link out of it); without one, any folder. ValueError naming the module."""
        if self.adapter_root is None:
            folder = Path(module.path).expanduser()
            if not folder.is_dir():
                raise ValueError(f"--lora-modules {module.name!r}: {module.path} is not a folder")
            return folder.resolve()
        from slora.api.adapter_files import resolve_in_root  # the engine's modules: loaded when needed only
        from slora.api.errors import APIError
        try:
            return resolve_in_root(Path(self.adapter_root), module.path, "path")
        except APIError as exc:
            raise ValueError(f"--lora-modules {module.name!r}: {exc.message}") from None

    def base_names_of(self, model_name: str) -> tuple[str, ...]:
        """What the base model answers to: the served_model_names if any (its own name then no longer), else
        its own name. The first is the one /v1/models lists and answers echo."""
        return self.served_model_names or (model_name,)

    @property
    def adapter_store_folder(self) -> Path:
        """Where the adapter store is: adapter_store, else a folder of the slora cache ($SLORA_CACHE or
        ~/.cache/slora), as the converted models."""
        if self.adapter_store is not None:
            return Path(self.adapter_store).expanduser()
        from slora.models.cache import cache_root
        return cache_root() / ADAPTER_STORE_NAME

    @property
    def single_user(self) -> bool:
        return self.tenants_file is None
