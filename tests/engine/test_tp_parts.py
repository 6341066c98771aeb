"""The parts of tensor parallelism that need no second process: each rank's part of the model and of an adapter
(whose products, put together as the collectives put them, are the whole model's), the packing of a part whose B
keeps more ranks than its A, the step's arrays as they travel, and the settings refused."""
import numpy as np
import pytest
import torch
from tiny import make_adapters, make_model

from slora.adapters.packing import buffer_layout
from slora.adapters.shapes import TargetShapes
from slora.adapters.sharding import AdapterSharding, shard_adapter
from slora.adapters.weights import LoadedAdapter, LoraWeights, load_adapter
from slora.config import EngineConfig
from slora.execution import step_batch
from slora.kernels.layout import align_up
from slora.models.config import UnsupportedModelError, load_model_config
from slora.models.loader import read_state_dict
from slora.models.registry import build_model
from slora.models.sharding import Shard, shard_state

SIZE = 2


def sharding(shapes: TargetShapes, fully_sharded: bool) -> AdapterSharding:
    return AdapterSharding(SIZE, fully_sharded, frozenset({"o_proj", "down_proj"}), shapes)


def module_parts(lora: LoraWeights, module: str, fully_sharded: bool, shapes: TargetShapes) -> list[LoraWeights]:
    adapter = LoadedAdapter(config=None, weights={(0, module): lora}, version="v")   # type: ignore[arg-type]
    return [shard_adapter(adapter, rank, sharding(shapes, fully_sharded)).weights[(0, module)]
            for rank in range(SIZE)]


@pytest.fixture(scope="module")
def shapes() -> TargetShapes:
    features = {"q_proj": (32, 16), "o_proj": (16, 32)}
    return TargetShapes(1, tuple(features.items()), ("self_attn.q_proj", "self_attn.o_proj"), "model.layers")


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("fully_sharded", [False, True])
def test_column_parallel_parts_give_the_ranks_output_columns(shapes, rank, fully_sharded):
    torch.manual_seed(rank)
    lora = LoraWeights(torch.randn(rank, 32, dtype=torch.float64), torch.randn(16, rank, dtype=torch.float64), 1.0)
    x = torch.randn(5, 32, dtype=torch.float64)                     # column-parallel: every rank reads all of x
    parts = module_parts(lora, "q_proj", fully_sharded, shapes)
    if fully_sharded:
        # Rank j shrinks to ranks j, j + SIZE, ...: the all-gather interleaves them into the whole h.
        shrinks = torch.stack([x @ part.lora_a.T for part in parts], dim=2)                 # [tokens, r/size, size]
        h = shrinks.reshape(5, -1)
        assert all(part.lora_a.shape[0] == -(-rank // SIZE) for part in parts)             # odd ranks padded
        deltas = [h @ part.lora_b.T for part in parts]
    else:
        deltas = [x @ part.lora_a.T @ part.lora_b.T for part in parts]
    torch.testing.assert_close(torch.cat(deltas, dim=1), x @ lora.lora_a.T @ lora.lora_b.T)


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_row_parallel_parts_sum_to_the_whole(shapes, fully_sharded):
    torch.manual_seed(0)
    lora = LoraWeights(torch.randn(4, 16, dtype=torch.float64), torch.randn(32, 4, dtype=torch.float64), 1.0)
    x = torch.randn(5, 16, dtype=torch.float64)
    x_parts = x.chunk(SIZE, dim=1)                                  # row-parallel: each rank holds its inputs
    parts = module_parts(lora, "o_proj", fully_sharded, shapes)
    if fully_sharded:
        h = sum(xs @ part.lora_a.T for xs, part in zip(x_parts, parts))                 # the all-reduced shrink
        whole = torch.cat([h @ part.lora_b.T for part in parts], dim=1)                  # each rank's columns
    else:
        whole = sum(xs @ part.lora_a.T @ part.lora_b.T for xs, part in zip(x_parts, parts))   # the base all-reduce
    torch.testing.assert_close(whole, x @ lora.lora_a.T @ lora.lora_b.T)


def test_a_part_whose_b_keeps_every_rank_is_packed_apart_from_the_next_module(shapes):
    part_shapes = TargetShapes(1, (("q_proj", (32, 8)), ("o_proj", (8, 32))), shapes.module_paths, "model.layers")
    lora = LoraWeights(torch.ones(8, 32), torch.ones(16, 8), 1.0)
    adapter = LoadedAdapter(config=None, weights={(0, "q_proj"): lora, (0, "o_proj"): lora}, version="v")  # type: ignore[arg-type]
    part = shard_adapter(adapter, 1, sharding(shapes, fully_sharded=True))
    descriptor, length = buffer_layout(part, part_shapes)
    q_a, q_b = part.weights[(0, "q_proj")].lora_a, part.weights[(0, "q_proj")].lora_b
    assert int(descriptor.ranks[0, 0]) == q_a.shape[0] == 4 and q_b.shape == (8, 8)        # A: r/2 rows; B: r
    assert int(descriptor.b_offsets[0, 0]) == 4 * align_up(32)
    assert int(descriptor.a_offsets[0, 1]) == int(descriptor.b_offsets[0, 0]) + 8 * align_up(8)
    assert length == int(descriptor.b_offsets[0, 1]) + part.weights[(0, "o_proj")].lora_b.shape[1] * align_up(16)


def test_model_parts_put_together_are_the_checkpoint(tmp_path):
    folder = make_model(tmp_path, "qwen2", seed=2)                   # q/k/v biases: split with their rows
    state = read_state_dict(folder)
    parts = [shard_state(state, Shard(rank, SIZE)) for rank in range(SIZE)]
    layer = "model.layers.1"
    for name, dim in ((f"{layer}.self_attn.q_proj.weight", 0), (f"{layer}.self_attn.k_proj.bias", 0),
                      (f"{layer}.mlp.up_proj.weight", 0), (f"{layer}.self_attn.o_proj.weight", 1),
                      (f"{layer}.mlp.down_proj.weight", 1)):
        assert torch.equal(torch.cat([part[name] for part in parts], dim=dim), state[name]), name
    assert all(torch.equal(part["model.embed_tokens.weight"], state["model.embed_tokens.weight"]) for part in parts)
    config = load_model_config(folder)
    model = build_model(config.sharded(SIZE), "meta")
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: tuple(parts[1][name].shape) for name in expected} == expected


def test_a_split_that_does_not_divide_the_heads_is_refused(tmp_path):
    config = load_model_config(make_model(tmp_path, "llama", seed=1))      # 4 heads, 2 KV heads
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=4 does not divide num_key_value_heads=2"):
        config.sharded(4)


def test_an_adapter_is_checked_against_the_whole_model(tmp_path):
    """Adapters are validated at their real shapes, then cut: a rank's part would have others."""
    model_dir = make_model(tmp_path, "llama", seed=1)
    path = make_adapters(model_dir, tmp_path, ["all-r16"])["all-r16"]
    whole = build_model(load_model_config(model_dir), "meta").lora_targets()
    loaded = load_adapter(path, whole, 64)
    part = shard_adapter(loaded, 1, sharding(whole, fully_sharded=False))
    q = part.weights[(0, "q_proj")]
    assert q.lora_a.shape == loaded.weights[(0, "q_proj")].lora_a.shape           # A whole: replicated
    assert q.lora_b.shape[0] * SIZE == loaded.weights[(0, "q_proj")].lora_b.shape[0]


def test_a_step_travels_as_ints_and_arrays():
    sizes = {"tokens": 7, "seqs": 3, "pages": 2, "slots": 2, "adapter_pages": 3, "layers": 2, "modules": 7}
    batch = step_batch.as_host(step_batch.empty(sizes, torch.device("cpu"), 16, 32))
    batch.lora.active = [[True, False] * 3 + [True], [False] * 7]
    batch.input_ids[:] = np.arange(7)
    ints, arrays = step_batch.flat_fields(batch)
    assert all(isinstance(value, int) for value in ints) and all(isinstance(a, np.ndarray) for a in arrays)
    back = step_batch.from_flat_fields(ints, [np.array(a) for a in arrays])
    assert back.lora is not None and back.lora.active == batch.lora.active and back.lora.max_rank == 32
    for name, tensor in step_batch.tensors_of(back.to(torch.device("cpu"))).items():
        assert torch.equal(tensor, step_batch.tensors_of(batch.to(torch.device("cpu")))[name]), name
    plain = step_batch.from_flat_fields(*step_batch.flat_fields(step_batch.as_host(
        step_batch.empty(sizes, torch.device("cpu"), 16, 32, with_lora=False))))
    assert plain.lora is None


@pytest.mark.parametrize("options, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ({"tensor_parallel_size": 2, "device": "cuda:1"}, "give device 'cuda'"),
    ({"tensor_parallel_size": 8, "device": "cuda"}, "needs 8 GPUs; this machine has 4"),
])
def test_tensor_parallel_settings_refused(monkeypatch, options, message):
    """Checked as on a machine of 4 GPUs (on one without CUDA a CUDA device is refused before these checks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
