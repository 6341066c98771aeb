"""benchmarks/serving.py's --engine-arg: the engine options reach the server it starts, as the flags `slora serve`
takes on the CPU and as the CUDA child's own options, so that one command can serve before and after a switch."""
from pathlib import Path

import pytest
import torch
from benchmark_modules import load_benchmark

from slora.cli import build_parser, engine_flags, engine_kwargs
from slora.config import EngineConfig, engine_config

SWITCHES = ["--engine-arg", "async_scheduling=false", "--engine-arg", "mixed_graph_tokens=0",
            "--engine-arg", "enforce_eager=true", "--engine-arg", "pdl=true", "--engine-arg", "swap_space_gib=0.5"]


@pytest.fixture(scope="module")
def serving():
    return load_benchmark("serving.py", "bench_serving_engine_args")


def command(serving, dummy: bool) -> list[str]:
    settings = serving.settings_from_args(serving.parse_args(["--device", "cpu", *SWITCHES]))
    setup = serving.ModelSetup(Path("model"), {}, "cpu", torch.float32, dummy, "a test model")
    return serving.server_command(setup, settings, 8123, Path("adapters"))


def assert_switched(config: EngineConfig) -> None:
    assert config.async_scheduling is False and config.swap_space_gib == 0.5
    assert (config.cuda.mixed_graph_tokens, config.cuda.enforce_eager, config.cuda.pdl) == (0, True, True)


def test_engine_args_reach_slora_serve_as_its_flags(serving):
    argv = command(serving, dummy=False)
    assert argv[1:4] == ["-m", "slora.cli", "serve"]
    assert_switched(EngineConfig(**engine_kwargs(build_parser().parse_args(argv[3:]))))


def test_engine_args_reach_the_cuda_child(serving):
    argv = command(serving, dummy=True)
    assert "--serve-child" in argv
    child = serving.parse_args(argv[2:])
    assert child.engine_arg == [("async_scheduling", False), ("mixed_graph_tokens", 0), ("enforce_eager", True),
                                ("pdl", True), ("swap_space_gib", 0.5)]
    assert_switched(serving.child_engine_config(child))


def test_no_engine_args_leave_the_server_at_its_defaults(serving):
    settings = serving.settings_from_args(serving.parse_args(["--device", "cpu"]))
    setup = serving.ModelSetup(Path("model"), {}, "cpu", torch.float32, False, "a test model")
    config = EngineConfig(**engine_kwargs(build_parser().parse_args(
        serving.server_command(setup, settings, 8123, Path("adapters"))[3:])))
    assert config.async_scheduling is True and config.cuda.mixed_graph_tokens == 512


def test_engine_args_are_refused_with_a_running_server(serving):
    args = serving.parse_args(["--url", "http://127.0.0.1:8000", "--engine-arg", "async_scheduling=false"])
    with pytest.raises(ValueError, match="--engine-arg configures the server this script starts"):
        serving.settings_from_args(args)


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_bool_either_way_becomes_a_flag_slora_serve_takes(serving, value):
    """Each bool field has one flag (--name for a False default, --no-name for a True one): a value equal to
    the default adds none."""
    for field in ("async_scheduling", "enforce_eager", "pdl", "enable_prefix_caching"):
        flags = engine_flags({field: value == "true"})
        args = build_parser().parse_args(["serve", *flags])
        assert getattr(args, field) is (value == "true"), (field, flags)


@pytest.mark.parametrize(("arg", "message"), [
    ("max_num_seqs=8", "set by this script"), ("device=cpu", "set by this script"),
    ("no_such_field=1", "not an EngineConfig or CudaConfig option"), ("max_loras=null", "give a value")])
def test_engine_args_the_script_cannot_pass_are_refused_before_a_server_starts(serving, arg, message):
    with pytest.raises(ValueError, match=message):
        serving.settings_from_args(serving.parse_args(["--device", "cpu", "--engine-arg", arg]))


def test_engine_config_puts_cuda_fields_into_the_cuda_config():
    config = engine_config(model="m", max_num_seqs=8, pdl=False, graph_few_adapters=2)
    assert (config.max_num_seqs, config.cuda.pdl, config.cuda.graph_few_adapters) == (8, False, 2)
    assert config.cuda.mixed_graph_tokens == 512          # the fields not given keep their defaults
    with pytest.raises(ValueError, match="mixed_graph_tokens must be >= 0"):
        engine_config(mixed_graph_tokens=-1)
