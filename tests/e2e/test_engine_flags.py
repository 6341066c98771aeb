"""`slora.cli.engine_flags`, the inverse of `engine_kwargs`: EngineConfig and CudaConfig fields given as the flags
`slora serve` takes, so that one command (benchmarks/serving.py's --engine-arg) can start a server with a switch
off and another with it on; and `slora.config.engine_config`, which puts CUDA fields into the CudaConfig."""
import pytest

from slora.cli import build_parser, engine_flags, engine_kwargs
from slora.config import EngineConfig, engine_config

SWITCHES = {"async_scheduling": False, "mixed_graph_tokens": 0, "enforce_eager": True, "pdl": True,
            "swap_space_gib": 0.5}


def test_engine_flags_reach_the_config_slora_serve_builds():
    args = build_parser().parse_args(["serve", *engine_flags(SWITCHES)])
    config = EngineConfig(**engine_kwargs(args))
    assert config.async_scheduling is False and config.swap_space_gib == 0.5
    assert (config.cuda.mixed_graph_tokens, config.cuda.enforce_eager, config.cuda.pdl) == (0, True, True)


def test_no_engine_flags_leave_the_defaults():
    assert engine_flags({}) == []
    config = EngineConfig(**engine_kwargs(build_parser().parse_args(["serve"])))
    assert config.async_scheduling is True and config.cuda.mixed_graph_tokens == 512


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_bool_either_way_becomes_a_flag_slora_serve_takes(value):
    """Each bool field has one flag (--name for a False default, --no-name for a True one): a value equal to
    the default adds none."""
    for field in ("async_scheduling", "enforce_eager", "pdl", "enable_prefix_caching"):
        flags = engine_flags({field: value == "true"})
        args = build_parser().parse_args(["serve", *flags])
        assert getattr(args, field) is (value == "true"), (field, flags)


@pytest.mark.parametrize(("options", "message"), [
    ({"no_such_field": 1}, "not an EngineConfig or CudaConfig option"), ({"max_loras": None}, "give a value")])
def test_options_no_flag_can_give_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        engine_flags(options)


def test_engine_config_puts_cuda_fields_into_the_cuda_config():
    config = engine_config(model="m", max_num_seqs=8, pdl=False, graph_few_adapters=2)
    assert (config.max_num_seqs, config.cuda.pdl, config.cuda.graph_few_adapters) == (8, False, 2)
    assert config.cuda.mixed_graph_tokens == 512          # the fields not given keep their defaults
    with pytest.raises(ValueError, match="mixed_graph_tokens must be >= 0"):
        engine_config(mixed_graph_tokens=-1)
