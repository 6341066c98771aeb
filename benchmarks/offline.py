"""Offline generation: slora against transformers + PEFT mixed-adapter `generate`, same prompts,
same adapters, same machine, in one run: the model's demo adapters mixed with the base model in every batch
(SmolLM2-135M-Instruct and its three trained adapters by default), random prompts of equal length, greedy,
ignore_eos.

    python benchmarks/offline.py [--quick] [--model NAME] [--out benchmarks/results/offline_cpu.json]
"""
import argparse
import logging
import time
from pathlib import Path

import torch

from common import RESULTS, print_table, write_json
from slora import LLM, SamplingParams
from slora.builtin_models import DEFAULT_MODEL, resolve_model


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 42) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(batch)]


def adapter_mix(batch: int, adapters: list[str]) -> list[str | None]:
    names = [*adapters, None]
    return [names[i % len(names)] for i in range(batch)]


def run_slora(llm: LLM, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, adapters=names)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    return len(prompts) * new_tokens / elapsed


def build_peft(model_dir, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


@torch.inference_mode()
def run_peft(model, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> float:
    input_ids = torch.tensor(prompts)                      # equal lengths: no padding needed
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         adapter_names=[n or "__base__" for n in names], max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a builtin model with demo adapters")
    parser.add_argument("--out", default=str(RESULTS / "offline_cpu.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(42)
    batches, prompt_len, new_tokens = ([1, 4], 16, 8) if args.quick else ([1, 8, 32], 64, 32)
    source = resolve_model(args.model)
    llm = LLM(args.model)
    peft_model = build_peft(source.folder, source.demo_adapters)
    adapters = list(source.demo_adapters)
    rows = []
    for batch in batches:
        prompts = make_prompts(batch, prompt_len, peft_model.config.vocab_size)
        names = adapter_mix(batch, adapters)
        run_slora(llm, prompts[:1], names[:1], 2)              # warm-up
        slora_tps = run_slora(llm, prompts, names, new_tokens)
        peft_tps = run_peft(peft_model, prompts, names, new_tokens)
        rows.append({"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "slora_tok_s": slora_tps, "peft_tok_s": peft_tps, "ratio": slora_tps / peft_tps})
    print_table(rows)
    write_json(Path(args.out), {"benchmark": "offline", "quick": args.quick, "model": args.model,
                                "adapters": adapters, "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
