"""Command line: `slora generate` (offline) and `slora serve` (HTTP)."""
import argparse
import dataclasses
import logging
import re
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slora.sampling.params import SamplingParams

if TYPE_CHECKING:
    from slora.api.cluster import ClusterOptions
    from slora.api.replica import Autoscaling
    from slora.api.settings import ServerSettings
    from slora.config import EngineConfig


def _config_fields(cls: type, skip: frozenset[str]) -> list[tuple[dataclasses.Field, type]]:
    """The fields of a config dataclass that are options, with the type an option parses."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name not in skip and "help" in f.metadata]
    return [(f, next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)))
            for f in fields]


def _engine_fields(skip: frozenset[str] = frozenset()) -> list[tuple[dataclasses.Field, type]]:
    """The option fields of EngineConfig, then of its CudaConfig."""
    from slora.config import CudaConfig, EngineConfig  # imported in the functions, as the commands do
    return _config_fields(EngineConfig, skip) + _config_fields(CudaConfig, skip)


def _flag(name: str, default: object, kind: type) -> str:
    """A field's flag: a bool field has one, --name when its default is False and --no-name when True."""
    negated = kind is bool and bool(default)
    return ("--no-" if negated else "--") + name.replace("_", "-")


# How the words of a field's name are written in a help text.
_SPELLING = {"pdl": "PDL", "lora": "LoRA", "kv": "KV"}


def _bool_help(field: dataclasses.Field) -> str:
    """A bool field's help describes the feature; its --no-name flag (default True) turns the feature off,
    so that flag's help says so first."""
    if not field.default:
        return field.metadata["help"]
    words = field.name.removeprefix("enable_").split("_")
    feature = " ".join(_SPELLING.get(word, word) for word in words)
    return f"turn off {feature} (on by default: {field.metadata['help']})"


def _add_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, field: dataclasses.Field,
                kind: type) -> None:
    flag = _flag(field.name, field.default, kind)
    shown = "" if field.default is None else f" (default: {field.default})"
    if kind is bool:
        parser.add_argument(flag, dest=field.name, default=field.default,
                            action="store_false" if field.default else "store_true", help=_bool_help(field))
        return
    parser.add_argument(flag, dest=field.name, type=kind, default=field.default, choices=field.metadata["choices"],
                        help=field.metadata["help"] + shown, metavar=None if field.metadata["choices"] else "X")


# Engine options a command takes from elsewhere: `generate --seed` is the sampling seed.
GENERATE_SKIPS = frozenset({"seed"})


def add_engine_args(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One option per EngineConfig (and CudaConfig) field, its help and default the field's. CudaConfig's
    go in a group of their own, after the rest: a CPU user can pass them by."""
    from slora.config import CudaConfig, EngineConfig
    for field, kind in _config_fields(EngineConfig, skip):
        _add_option(parser, field, kind)
    cuda = parser.add_argument_group("CUDA only", "read with --device cuda; the CPU engine ignores them")
    for field, kind in _config_fields(CudaConfig, skip):
        _add_option(cuda, field, kind)


def engine_flags(options: dict[str, Any]) -> list[str]:
    """The flags that give these EngineConfig or CudaConfig fields these values (the inverse of
    engine_kwargs): a bool that is its field's default needs no flag. Refuses a field that has no flag, or a
    value of None, which no flag gives."""
    fields = {f.name: (f, kind) for f, kind in _engine_fields()}
    flags: list[str] = []
    for name, value in options.items():
        if name not in fields:
            raise ValueError(f"{name}: not an EngineConfig or CudaConfig option")
        if value is None:
            raise ValueError(f"{name}: give a value (no flag sets None)")
        field, kind = fields[name]
        if kind is not bool:
            flags += [_flag(name, field.default, kind), str(value)]
        elif value != field.default:
            flags.append(_flag(name, field.default, kind))
    return flags


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from the parsed options (CUDA ones as one CudaConfig)."""
    from slora.config import CudaConfig, EngineConfig
    kwargs = {f.name: getattr(args, f.name) for f, _ in _config_fields(EngineConfig, frozenset())
              if hasattr(args, f.name)}
    cuda = {f.name: getattr(args, f.name) for f, _ in _config_fields(CudaConfig, frozenset())}
    return {**kwargs, "cuda": CudaConfig(**cuda)}


# "owner/name" as the Hugging Face Hub spells its ids: what a user coming from vLLM or transformers gives.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model(model: str | None, load_format: str, adapter_flag: str) -> None:
    """Refuse a --model that cannot load with one line saying why and what to give instead (ValueError), before
    a command starts anything: the model loads on the engine's thread, after `slora serve` has bound its port.
    `adapter_flag` is how the command loads an adapter, for a user who gave an adapter's folder."""
    from slora.models.builtin import DEFAULT_MODEL, TINY_MODEL, packaged_smollm2_file
    name = model or DEFAULT_MODEL
    if name == TINY_MODEL:
        return
    if name == DEFAULT_MODEL:
        _check_file(packaged_smollm2_file(), f"the default model {DEFAULT_MODEL}'s file")
        return
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        _check_file(path, f"--model {name}")
        return
    problem = _folder_problem(name, path, adapter_flag) or _config_problem(path, load_format)
    if problem is not None:
        raise ValueError(f"--model {name}: {problem}")


def _check_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise ValueError(f"{what}: no such file ({path})")


def _folder_problem(name: str, path: Path, adapter_flag: str) -> str | None:
    """Why `path` is not a model folder: missing (maybe a Hub id), a file, or a folder without config.json
    (maybe an adapter's); None when it has a config.json."""
    if not path.exists():
        if _HUB_ID.fullmatch(name) and not name.startswith("."):
            return (f"no such folder; slora does not download Hub ids (it uses no network): download the model "
                    f"first (e.g. `hf download {name} --local-dir DIR`) and give its local folder")
        from slora.models.builtin import DEFAULT_MODEL, TINY_MODEL
        return (f"no such folder; give a local model folder (with config.json), a .gguf file, {DEFAULT_MODEL} "
                f"(the default) or {TINY_MODEL}")
    if not path.is_dir():
        return "is a file, not a folder; give a model folder (with config.json) or a .gguf file"
    if (path / "config.json").is_file():
        return None
    if (path / "adapter_config.json").is_file():
        return (f"is a LoRA adapter folder (it has adapter_config.json), not a model; give its base model's "
                f"folder as --model and the adapter with {adapter_flag} NAME={name}")
    return ("folder has no config.json: a model folder holds the Hugging Face files (config.json, the "
            "*.safetensors weights, the tokenizer's files)")


def _config_problem(path: Path, load_format: str) -> str | None:
    """Why the config.json of `path` or its weights cannot load: a model slora does not serve, no safetensors."""
    from slora.models.config import load_model_config
    from slora.models.loader import safetensors_files
    try:
        load_model_config(path)
        if load_format != "dummy":              # "dummy" draws random weights: the folder needs none
            safetensors_files(path)
    except KeyError as exc:
        return f"config.json has no {exc}"
    except ValueError as exc:                   # UnsupportedModelError, and json's JSONDecodeError
        return str(exc)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora", description="multi-LoRA LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts offline and print the completions")
    add_engine_args(gen, GENERATE_SKIPS)
    gen.add_argument("prompts", nargs="*", default=["Hello, how are you?"])
    gen.add_argument("--adapter", default=None, help="adapter name (the default model has demo-pirate, "
                     "demo-caps, demo-json)")
    gen.add_argument("--load-adapter", action="append", default=[], metavar="NAME=PATH",
                     help="load a PEFT folder under NAME first (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    add_serve_parser(commands)
    return parser


# `slora serve` flags of ServerSettings' limits: (flag, field, type, help). Their defaults are ServerSettings';
# a flag not given leaves the field at its default, so the values are validated in one place.
SERVE_LIMITS = (
    ("--max-n", "max_n", int, "samples per prompt (n)"),
    ("--max-choices", "max_choices", int, "prompts x n in one request"),
    ("--max-tokens-limit", "max_tokens_limit", int, "largest max_tokens (default: the model's context)"),
    ("--max-stop-sequences", "max_stop_sequences", int, "stop sequences in one request"),
    ("--max-stop-length", "max_stop_length", int, "characters of one stop sequence"),
    ("--max-prompt-chars", "max_prompt_chars", int, "characters of text in one request (prompts or messages)"),
    ("--max-body-bytes", "max_body_bytes", int, "bytes of a request body, JSON or other (413 beyond)"),
    ("--max-upload-bytes", "max_upload_bytes", int,
     "bytes of a multipart adapter upload to /v1/adapters (413 beyond)"),
    ("--max-adapter-bytes", "max_adapter_bytes", int,
     "bytes of adapter files one tenant's adapters may hold, uploaded or loaded by path, unless the tenants "
     "file gives the tenant its own max_adapter_bytes (default: no limit; 403 beyond)"),
    ("--max-pending-requests", "max_pending_requests", int, "requests in the engine plus queued ones (429 beyond)"),
    ("--retry-after", "retry_after_s", int, "seconds the Retry-After header of 429 and 503 answers says"),
    ("--tokenizer-workers", "tokenizer_workers", int, "threads tokenizing prompts"),
    ("--max-tokenize-pending", "max_tokenize_pending", int,
     "requests waiting for a tokenizer thread, at most half of them one tenant's (429 beyond)"),
    ("--shutdown-timeout", "shutdown_timeout_s", float, "seconds in-flight requests get to finish on SIGTERM"),
    ("--stall-timeout", "stall_timeout_s", float, "/health fails while one engine step runs longer (seconds)"),
    ("--timeout-keep-alive", "timeout_keep_alive_s", float,
     "seconds an idle connection stays open after its last response"),
    ("--timeout-header", "timeout_header_s", float,
     "seconds a client has to send a request's headers, from the connection's start or the request's first byte"),
    ("--timeout-body-idle", "timeout_body_idle_s", float,
     "seconds a request body may pause before the connection is closed"),
    ("--max-connections", "max_connections", int,
     "requests in progress at once (503 beyond); also the bound on idle connections of all clients, beyond which "
     "the oldest idle connection of the client address holding the most is closed"),
    ("--connection-reserve", "connection_reserve", int,
     "of --max-connections, the request slots kept for /health and requests with a valid key (every request in "
     "single-user mode); other requests get 503 once the rest are taken (default: 10%%, at least 1)"),
    ("--max-connections-per-client", "max_connections_per_client", int,
     "idle connections (none sent yet, or keep-alive between requests) of one client address; beyond, its "
     "oldest idle one is closed. Behind a proxy every client has the proxy's address"),
    ("--min-body-rate", "min_body_rate", int,
     "bytes/s a request body must keep up, per window of --timeout-body-idle from its start; a slower one is "
     "answered 408 and its connection closed (0: not checked)"),
    ("--grammar-compile-timeout", "grammar_compile_timeout_s", float,
     "seconds one structured-output spec may take to compile, in a worker process (400 beyond)"),
    ("--grammar-max-bytes", "grammar_max_bytes", int, "bytes of one compiled structured-output grammar (400 beyond)"),
    ("--grammar-max-compile-bytes", "grammar_max_compile_bytes", int,
     "bytes a compile worker may grow by while it compiles one spec (400 beyond)"),
    ("--grammar-cache-bytes", "grammar_cache_bytes", int,
     "bytes of compiled grammars kept for reuse, all tenants together; the tenant holding most gives way first"),
    ("--grammar-workers", "grammar_workers", int, "worker processes compiling structured-output specs"),
    ("--grammar-max-pending", "grammar_max_pending", int,
     "one tenant's structured-output compiles queued or running (429 beyond)"),
)


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from slora.api.settings import TOOL_CALL_PARSERS, ServerSettings
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP service")
    add_engine_args(serve)
    replicas = serve.add_argument_group("replicas", "engines on Ray Serve behind this server (Ray is needed only here)")
    replicas.add_argument("--replicas", type=int, default=None, metavar="N",
                          help="serve through N engine replicas on Ray Serve instead of one engine in this process")
    replicas.add_argument("--ray-address", default=None, metavar="ADDR",
                          help="the Ray cluster to join (default: start one of this process's own)")
    replicas.add_argument("--replica-gpus", type=float, default=1.0, help="GPUs per replica (default: %(default)s)")
    replicas.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (default: %(default)s)")
    replicas.add_argument("--autoscale-min", type=int, default=None, metavar="N",
                          help="let Ray Serve scale the replicas between --autoscale-min and --autoscale-max, "
                               "from --replicas (both needed)")
    replicas.add_argument("--autoscale-max", type=int, default=None, metavar="N", help="see --autoscale-min")
    replicas.add_argument("--autoscale-target", type=float, default=None, metavar="REQUESTS",
                          help="ongoing requests per replica that autoscaling aims at (default: --max-num-seqs, "
                               "a full batch)")
    replicas.add_argument("--replica-drain-timeout", type=float, default=300.0, metavar="S",
                          help="seconds a replica being removed (scale-down, redeploy) may take to finish its "
                               "requests; it takes no new ones (default: %(default)s)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; one that is not loopback (0.0.0.0: every interface) needs "
                            "--tenants or --allow-unauthenticated (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--tenants", default=None, metavar="FILE",
                       help="tenants TOML (API key hashes, roles, limits); without it: single-user mode, loopback only")
    serve.add_argument("--adapter-root", default=None, metavar="DIR",
                       help="folder that adapters loaded by path must be inside")
    serve.add_argument("--adapter-store", default=None, metavar="DIR",
                       help="where the adapters loaded through the API are kept (uploads' files; path loads by "
                            "their path in --adapter-root) and restored from at start; one server at a time "
                            "(default: adapter-store in the slora cache, $SLORA_CACHE or ~/.cache/slora)")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="allow single-user mode (no API keys) on a non-loopback address")
    serve.add_argument("--metrics-require-key", action="store_true",
                       help="/metrics answers only requests with the key of a tenant whose role is admin in the "
                            "tenants file (401 without a valid key, 403 for other tenants); needs --tenants")
    serve.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                       help="adapters to load at start: NAME=PATH, or vLLM's JSON form "
                            '\'{"name": ..., "path": ..., "base_model_name": ...}\' (base_model_name is not used); '
                            "each PATH inside --adapter-root if one is given; checked as the admin load route checks "
                            "them, and a bad one stops the start. They are public: every caller may use them (with "
                            "--tenants they belong to no tenant; only admins may unload them)")
    serve.add_argument("--enable-lora-resolver", action="store_true",
                       help="a request whose model names an adapter that is not loaded loads "
                            "<adapter-root>/<model> on first use, into the caller's namespace (with --tenants, "
                            "the tenant's own, within its adapter quotas); needs --adapter-root")
    serve.add_argument("--served-model-name", dest="served_model_names", nargs="+", action="extend", default=[],
                       metavar="NAME",
                       help="the names the base model answers to (the first is the one /v1/models lists and "
                            "answers echo); its own name is then no longer accepted")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="parse tool calls out of chat answers to requests with tools (message.tool_calls, "
                            'finish_reason "tool_calls"); needs --tool-call-parser')
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how tool calls are written: hermes is <tool_call>{\"name\": ..., \"arguments\": "
                            "{...}}</tool_call> (Hermes, Qwen2.5 and others)")
    defaults = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
    for flag, field, kind, help_text in SERVE_LIMITS:
        shown = "" if defaults[field] is None else f" (default: {defaults[field]})"
        serve.add_argument(flag, dest=field, type=kind, default=argparse.SUPPRESS, help=help_text + shown,
                           metavar="SECONDS" if kind is float else "N")


def serve_settings(args: argparse.Namespace) -> "ServerSettings":
    """The ServerSettings of `slora serve`'s arguments (ValueError naming a bad one)."""
    from slora.api.settings import ServerSettings, parse_lora_module
    limits = {field: getattr(args, field) for _, field, _, _ in SERVE_LIMITS if hasattr(args, field)}
    return ServerSettings(host=args.host, port=args.port, tenants_file=args.tenants, adapter_root=args.adapter_root,
                          adapter_store=args.adapter_store, allow_unauthenticated=args.allow_unauthenticated,
                          metrics_require_key=args.metrics_require_key,
                          lora_modules=tuple(parse_lora_module(item) for item in args.lora_modules),
                          enable_lora_resolver=args.enable_lora_resolver,
                          served_model_names=tuple(args.served_model_names),
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser, **limits)


def run_serve(args: argparse.Namespace) -> int:
    from slora.config import EngineConfig

    settings = serve_settings(args)
    if settings.tenants_file is not None:        # fail fast on a bad tenants file, before loading the model
        from slora.api.tenants import load_tenants
        load_tenants(settings.tenants_file)
    config = EngineConfig(**engine_kwargs(args))
    cluster = _cluster_options(args, config)
    if settings.tenants_file is not None and config.scheduling_policy is None:
        config.scheduling_policy = "vtc"         # tenants share the engine fairly unless told otherwise
    check_model(config.model, config.load_format, "--lora-modules")    # before the port is bound
    # Imported once the arguments are checked: the server's modules (transformers, fastapi) take seconds.
    from slora.api.server import serve
    return serve(settings, config, cluster)


def _cluster_options(args: argparse.Namespace, config: "EngineConfig") -> "ClusterOptions | None":
    """The replicas of --replicas, or None for one engine in this process."""
    if args.replicas is None:
        given = [flag for flag in ("ray_address", "autoscale_min", "autoscale_max", "autoscale_target")
                 if getattr(args, flag) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --replicas")
        return None
    import importlib.util
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--replicas needs Ray: install slora's ray extra (pip install 'slora[ray]')")
    from slora.api.cluster import ClusterOptions
    return ClusterOptions(args.replicas, args.ray_address, args.replica_gpus, args.replica_cpus,
                          _autoscaling(args, config), args.replica_drain_timeout)


def _autoscaling(args: argparse.Namespace, config: "EngineConfig") -> "Autoscaling | None":
    if args.autoscale_min is None and args.autoscale_max is None:
        if args.autoscale_target is not None:
            raise ValueError("--autoscale-target needs --autoscale-min and --autoscale-max")
        return None
    if args.autoscale_min is None or args.autoscale_max is None:
        raise ValueError("autoscaling needs both --autoscale-min and --autoscale-max")
    from slora.api.replica import Autoscaling
    return Autoscaling(min_replicas=args.autoscale_min, max_replicas=args.autoscale_max,
                       target_ongoing_requests=config.max_num_seqs if args.autoscale_target is None
                       else args.autoscale_target)


def run_generate(args: argparse.Namespace) -> int:
    from slora.llm import LLM

    check_model(args.model, args.load_format, "--load-adapter")
    llm = LLM(**engine_kwargs(args))
    for spec in args.load_adapter:
        name, _, path = spec.partition("=")
        llm.load_adapter(name, path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    adapters = [args.adapter] * len(args.prompts)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, adapters)
    else:
        outputs = llm.generate(args.prompts, params, adapters)
    for prompt, output in zip(args.prompts, outputs):
        sys.stdout.write(f"{prompt!r} -> {output.text!r} [{output.finish_reason}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
    except ValueError as exc:          # bad input: a clear message, not a traceback
        sys.stderr.write(f"slora: error: {exc}\n")
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
