"""max_loras: at most that many distinct adapters in a batch; the order of work changes, outputs do not."""
import pytest
from tiny import random_prompts

from slora import LLM, SamplingParams
from slora.config import CudaConfig, EngineConfig
from slora.execution.cuda_graphs import GraphLimits


def test_max_loras_changes_the_order_not_the_outputs(tiny_llama):
    prompts = random_prompts([12, 30, 7, 21, 16, 9], seed=6)
    names = ["attn-r4", "mlp-r8", "all-r16", None, "attn-r4", "rs-pattern"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    def run(**kwargs) -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny_llama.model_dir), num_pages=256, **kwargs)
        for name, path in tiny_llama.adapters.items():
            llm.load_adapter(name, str(path))
        peak = 0
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            llm.engine.add_request(f"r{i}", prompt, params, name)
        outputs = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            peak = max(peak, len(llm.engine.scheduler.running_versions()))
            llm.engine.check()
        return [outputs[f"r{i}"] for i in range(len(prompts))], peak

    capped, capped_peak = run(max_loras=1)
    free, free_peak = run()
    assert capped == free
    assert capped_peak == 1 and free_peak == 4


def test_max_loras_must_be_positive():
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(max_loras=0)


def test_graph_few_adapters_must_not_be_negative():
    with pytest.raises(ValueError, match="graph_few_adapters"):
        CudaConfig(graph_few_adapters=-1)


FULL = [(False, False), (True, False)]


@pytest.mark.parametrize("max_loras,few,batch,kinds,few_slots", [
    (None, 4, 64, FULL + [(True, True)], 4),
    (None, 4, 4, FULL, 4),                   # the full graph has 4 slots already
    (2, 4, 64, FULL, 2),                     # max_loras leaves 2 slots
    (None, 0, 64, FULL, 0),
    (None, 4, 2, FULL, 2),                   # a bucket smaller than the few-adapter count
])
def test_few_adapter_graphs_only_where_they_differ(max_loras, few, batch, kinds, few_slots):
    """A bucket gets a few-adapter graph only where it has fewer adapter slots than its full graph:
    another graph costs capture time and memory."""
    limits = GraphLimits(max_batch=64, max_blocks=8, max_adapter_pages=4, max_lora_rank=16, num_layers=2,
                         num_lora_modules=7, max_loras=max_loras, few_adapters=few)
    assert limits.graph_kinds(batch) == kinds
    assert limits.adapter_slots(batch, few=True) == few_slots


def test_cli_engine_flags_reach_the_config():
    from slora.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["generate", "--no-pdl", "--graph-few-adapters", "2", "--max-loras", "3", "hi"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.cuda.pdl, config.cuda.graph_few_adapters, config.max_loras) == (False, 2, 3)
    assert EngineConfig(**engine_kwargs(build_parser().parse_args(["generate", "hi"]))).cuda.pdl is True


def test_llm_takes_cuda_settings_as_keywords():
    """LLM(...) keeps the flat keywords of the public contract: CudaConfig's fields go into config.cuda."""
    from slora.models.builtin import TINY_MODEL
    llm = LLM(TINY_MODEL, num_pages=16, gpu_memory_utilization=0.5, graph_few_adapters=2)
    assert llm.engine.config.cuda == CudaConfig(gpu_memory_utilization=0.5, graph_few_adapters=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(TINY_MODEL, num_pages=16, gpu_memory_utilization=1.5)
