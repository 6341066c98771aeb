"""Loading Hugging Face folders: rope scaling, tied embeddings, shards, dtypes, unsupported models."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import force_lora_deltas, make_adapters, make_model, oracle_greedy, random_prompts, record_attention

from slora import LLM, SamplingParams
from slora.execution.step_batch import StepLora
from slora.models.config import UnsupportedModelError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
THREE = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_tied_embeddings_and_explicit_head_dim_match_peft(tmp_path):
    model_dir = make_model(tmp_path, "llama", seed=9, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                           head_dim=64, max_position_embeddings=1024)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    adapters = make_adapters(model_dir, tmp_path, ["all-r16"])
    prompts = random_prompts([150, 3], seed=8)                  # past original_max_position_embeddings
    expected = oracle_greedy(model_dir, adapters, prompts, ["all-r16", None], GREEDY.max_tokens)
    llm = LLM(str(model_dir), num_pages=128)
    llm.load_adapter("all-r16", str(adapters["all-r16"]))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, adapters=["all-r16", None])] == expected


def test_sharded_checkpoint_loads(tiny_llama, tmp_path):
    state = load_file(str(tiny_llama.model_dir / "model.safetensors"))
    folder = tmp_path / "sharded"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_llama.model_dir / name).read_bytes())
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (("model-00001-of-00002.safetensors", names[:half]),
                        ("model-00002-of-00002.safetensors", names[half:])):
        save_file({n: state[n] for n in part}, str(folder / shard))
        weight_map.update({n: shard for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = random_prompts([10], seed=2)
    sharded = LLM(str(folder), num_pages=64).generate(prompt, GREEDY)[0].token_ids
    single = LLM(str(tiny_llama.model_dir), num_pages=64).generate(prompt, GREEDY)[0].token_ids
    assert sharded == single


def test_unsupported_architecture_is_named(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = json.loads((tiny_llama.model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(folder))


def test_pickled_checkpoint_is_refused(tiny_llama, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_bytes((tiny_llama.model_dir / "config.json").read_bytes())
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="pickled weights are never loaded"):
        LLM(str(folder))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_track_float32(tiny_llama, dtype):
    prompt = random_prompts([20], seed=3)[0]
    logits = {}
    for name in ("float32", dtype):
        llm = LLM(str(tiny_llama.model_dir), dtype=name, num_pages=64)
        llm.load_adapter("a", str(tiny_llama.adapters["rs-pattern"]))
        llm.engine.add_request("r", prompt, GREEDY, "a")
        out = llm.engine.scheduler.schedule()
        adapters = {v: (llm.engine.adapters.versions[v].descriptor, r.pages)
                    for v, r in llm.engine.adapters.resident.items()}
        llm.engine.runner.move_pages(out, llm.engine.adapters.packed(v for v, _ in out.adapters_to_load))
        logits[name] = llm.engine.runner.run(out.scheduled, adapters)[0]
    similarity = torch.nn.functional.cosine_similarity(logits["float32"], logits[dtype], dim=0)
    assert similarity > 0.99


def test_prompt_longer_than_context_is_refused(tiny_llama):
    llm = LLM(str(tiny_llama.model_dir), num_pages=64, max_model_len=32)
    with pytest.raises(ValueError, match="context is 32 tokens"):
        llm.generate([[5] * 40], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], GREEDY)
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2
    assert llm.pool_stats()["kv_pages"] == 0


@pytest.mark.parametrize("prompt", [[5, -1], [5, 512], [5, 2.0], [5, "6"], [5, None], [5, 2 ** 70], [[5], [6, 7]],
                                    [True, False]])
def test_a_prompt_with_any_entry_not_a_token_id_is_refused(prompt):
    from slora.sampling.request_state import check_prompt

    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        check_prompt(prompt, 512, 64)


def test_a_prompt_of_token_ids_at_the_vocabulary_edges_is_taken():
    from slora.sampling.request_state import check_prompt, ids_in_vocabulary

    assert check_prompt([0, 511, 7], 512, 64) is None     # raises if it refuses them
    assert ids_in_vocabulary([0, 511, 7], 512) and not ids_in_vocabulary([0, 512, 7], 512)
    assert ids_in_vocabulary([], 512) and not ids_in_vocabulary([[]], 512)   # no entry (check_prompt refuses [])


def test_elementwise_ops_pass_pdl_to_the_cuda_kernels(monkeypatch):
    # The CUDA branch of slora.models.ops, without a GPU: a tensor stand-in that says it is on CUDA and
    # recording kernels in place of the Triton ones.
    from slora.kernels import fused_ops
    from slora.models import ops
    calls = []
    for name in ("rms_norm", "rotary_qk_", "silu_and_mul"):
        monkeypatch.setattr(fused_ops, name, lambda *args, pdl, name=name, **kwargs:
                            calls.append((name, len(args), pdl, kwargs)))

    class OnCuda:
        is_cuda = True

    x = OnCuda()
    ops.rms_norm(x, "weight", 1e-6, pdl=True)
    ops.rotary_qk_(x, "cos", "sin", 8, 2, 64, "pool", pdl=False)
    ops.silu_and_mul(x, pdl=True)
    assert calls == [("rms_norm", 3, True, {}), ("rotary_qk_", 6, False, {"kv": "pool"}),
                     ("silu_and_mul", 1, True, {})]


@pytest.mark.parametrize("supported", [True, False])
@pytest.mark.parametrize("asked", [True, False])
def test_cuda_backends_use_pdl_only_where_asked_and_supported(monkeypatch, asked, supported):
    # Building the CUDA ops touches no GPU; whether the GPU has PDL is the stubbed answer.
    from slora.execution import attention_backend
    from slora.kernels import pdl
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: supported)
    attention, lora = attention_backend.backends_for(torch.device("cuda"), pdl=asked)
    assert attention.pdl is lora.pdl is (asked and supported)
    tables = torch.zeros(2, 7, 1, dtype=torch.int32)                  # [layers, modules, slots]
    step = lora.step(StepLora(token_slots=torch.tensor([0, -1], dtype=torch.int32),
                              page_tables=torch.zeros(1, 1, dtype=torch.int32), ranks=tables, a_offsets=tables.long(),
                              b_offsets=tables.long(), scalings=tables.float(), max_rank=16, active=[[True] * 7] * 2))
    assert step.kernels.pdl is (asked and supported)


@pytest.mark.parametrize("deltas", [False, True])
def test_last_layer_runs_its_mlp_on_the_sampled_rows_alone(tiny_llama, monkeypatch, deltas):
    """A prefill's last layer computes from q on only the rows that are sampled, each with its own adapter
    (added after the GEMM, or as a delta), its attention as decode queries; the tokens are the oracle's."""
    from slora.models.llama import MLP
    if deltas:
        force_lora_deltas(monkeypatch)
    seen: list[tuple[int, int]] = []                  # (layer, rows) of each MLP call
    forward = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x, residual, ctx: (seen.append((self.layer, x.shape[0])),
                                                                        forward(self, x, residual, ctx))[1])
    attended = record_attention(monkeypatch)
    prompts = random_prompts([20, 9, 13], seed=4)
    names = [None, "all-r16", "mlp-r8"]
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 3)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    for name in names[1:]:
        llm.load_adapter(name, str(tiny_llama.adapters[name]))
    assert [o.token_ids for o in llm.generate(prompts, THREE, adapters=names)] == expected
    assert seen[:2] == [(0, 42), (1, 3)]              # the prefill step: 42 rows, then the 3 sampled
    # The prefill step's last attention takes its 3 sampled rows; a decode step, all of whose rows are
    # sampled, attends whole.
    assert attended[:4] == [("all", 42), ("rows", 3), ("all", 3), ("all", 3)]


def test_a_step_of_prompt_logprobs_runs_its_last_layer_whole(tiny_llama, monkeypatch):
    """More sampled rows than sequences (one prompt's logprobs): as decode queries each row would read its
    whole context again, so that step's last layer attends whole; the other prompt's tokens are the oracle's."""
    attended = record_attention(monkeypatch)
    prompts = random_prompts([12, 10], seed=8)
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts[1:], [None], 3)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    with_logprobs = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(prompts, [with_logprobs, THREE])
    assert outputs[1].token_ids == expected[0] and len(outputs[0].prompt_logprobs) == 12
    assert attended[:2] == [("all", 22), ("all", 22)]         # 13 rows sampled of 22: the layer whole


def test_a_chunk_step_that_samples_nothing_runs_no_last_layer_rows(tiny_llama, monkeypatch):
    """A prompt chunked over steps of 16 tokens, alone: its first steps sample no row, so their last layer
    computes none past the attention (and no LoRA); the tokens are still the oracle's."""
    from slora.execution.lora_backend import LoraStep
    from slora.models.llama import MLP
    seen: list[tuple[int, int]] = []
    forward, lora_rows = MLP.forward, LoraStep.rows
    monkeypatch.setattr(MLP, "forward", lambda self, x, residual, ctx: (seen.append((self.layer, x.shape[0])),
                                                                        forward(self, x, residual, ctx))[1])
    cut: list[int] = []                               # rows of each LoRA cut to sampled rows
    monkeypatch.setattr(LoraStep, "rows", lambda self, rows: (cut.append(rows.shape[0]), lora_rows(self, rows))[1])
    prompt = random_prompts([40], seed=6)
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompt, ["all-r16"], 3)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64, max_num_batched_tokens=16)
    llm.load_adapter("all-r16", str(tiny_llama.adapters["all-r16"]))
    assert llm.generate(prompt, THREE, adapters=["all-r16"])[0].token_ids == expected[0]
    assert seen[:6] == [(0, 16), (1, 0), (0, 16), (1, 0), (0, 8), (1, 1)]
    assert cut == [1]                                 # the step that completes the prompt alone


@pytest.mark.parametrize("deltas", [False, True])
def test_o_proj_and_down_proj_add_into_the_residual_stream_in_place(tiny_llama, monkeypatch, deltas):
    """The tokens are the oracle's, with each token's LoRA added after the GEMM or as a delta. Without deltas,
    every layer but the last (cut to its sampled rows) returns its residual stream in the storage it got:
    o_proj and down_proj wrote into it (a delta, added by the norm, gives the stream new storage)."""
    from slora.models.llama import DecoderLayer
    if deltas:
        force_lora_deltas(monkeypatch)
    same_storage: list[bool] = []
    forward = DecoderLayer.forward

    def layer(self, x, ctx, rows=None):
        out = forward(self, x, ctx, rows)
        same_storage.append(out.out.data_ptr() == x.out.data_ptr())
        return out
    monkeypatch.setattr(DecoderLayer, "forward", layer)
    prompts = random_prompts([20, 9, 13], seed=5)
    names = ["all-r16", None, "mlp-r8"]
    expected = oracle_greedy(tiny_llama.model_dir, tiny_llama.adapters, prompts, names, 3)
    llm = LLM(str(tiny_llama.model_dir), num_pages=64)
    for name in ("all-r16", "mlp-r8"):
        llm.load_adapter(name, str(tiny_llama.adapters[name]))
    assert [o.token_ids for o in llm.generate(prompts, THREE, adapters=names)] == expected
    layers = len(same_storage) // 3                        # three steps: the prefill, then two decodes
    if not deltas:
        assert layers >= 2 and same_storage[:layers - 1] == [True] * (layers - 1)


@pytest.mark.parametrize("deltas", [False, True])
def test_biased_o_proj_and_mlp_add_their_bias_into_the_residual_stream(tmp_path, monkeypatch, deltas):
    """With attention_bias and mlp_bias (Llama's options), o_proj and down_proj still add their bias when they
    write into the residual stream: random non-zero biases (Hugging Face initialises them to zero), the
    oracle's tokens, each token's LoRA added after the GEMM or as a delta."""
    if deltas:
        force_lora_deltas(monkeypatch)
    model_dir = make_model(tmp_path, "llama", seed=11, attention_bias=True, mlp_bias=True)
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    generator = torch.Generator().manual_seed(12)
    biases = [name for name in state if name.endswith(".bias")]
    assert any("o_proj" in name for name in biases) and any("down_proj" in name for name in biases)
    for name in biases:
        state[name] = torch.randn(state[name].shape, generator=generator) * 0.5
    save_file(state, str(path), metadata={"format": "pt"})
    adapters = make_adapters(model_dir, tmp_path, ["all-r16"])
    prompts = random_prompts([17, 6], seed=13)
    names = ["all-r16", None]
    expected = oracle_greedy(model_dir, adapters, prompts, names, GREEDY.max_tokens)
    llm = LLM(str(model_dir), num_pages=64)
    llm.load_adapter("all-r16", str(adapters["all-r16"]))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, adapters=names)] == expected


def test_dummy_weights_are_drawn_as_vllms_dummy_loader_draws_them(tmp_path):
    # Every parameter, norms included, uniform in [-1e-3, 1e-3] (vLLM's initialize_dummy_weights): benchmarks
    # against vLLM's figures compute on data of its distribution. The folder holds config.json alone.
    from slora.models.loader import DUMMY_RANGE, load_model
    model_dir = make_model(tmp_path, "llama", seed=3)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    model = load_model(config_only, torch.float32, torch.device("cpu"), load_format="dummy")
    values = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert DUMMY_RANGE == 1e-3 and values.abs().max() <= DUMMY_RANGE
    assert values.std() == pytest.approx(DUMMY_RANGE / 3 ** 0.5, rel=0.05)      # uniform, not all one value
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms and all(p.abs().max() <= DUMMY_RANGE for p in norms)
