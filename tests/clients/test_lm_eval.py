"""lm-eval's `local-completions` against `slora serve`: what customers run to evaluate a fine-tune.

A multiple-choice task of a few documents, from a local jsonl file, through lm-eval's Python API. Each choice is
a loglikelihood request: token-id prompts with `echo: true, logprobs: 1, max_tokens: 1, temperature: 0`, whose
continuation's token_logprobs lm-eval sums. Every one must equal the offline engine's prompt logprobs.

Needs lm-eval with its API extra (in the dev extras). By hand: `pip install 'lm-eval[api]'`, then
`pytest tests/clients/test_lm_eval.py`."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from slora import SamplingParams
from slora.models.builtin import DEFAULT_MODEL

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'lm-eval[api]'")
pytest.importorskip("aiohttp", reason="lm-eval's API models need its [api] extra: pip install 'lm-eval[api]'")

DRIVER = Path(__file__).with_name("lm_eval_driver.py")
TIMEOUT_S = 300        # a guard against a hang, not a speed check: the run takes 15-60 s on 2 cores
TASK = "slora_clients_mc"
LONG_CONTEXT = ("Argentina is a country in the southern half of South America. It shares the bulk of the Southern "
                "Cone with Chile to the west, and is also bordered by Bolivia and Paraguay to the north. "
                "The largest city of Argentina is")
# Multi-token continuations, and a context of several whole pages (the prefix cache must not skip its logprobs).
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven", "ten"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Fahrenheit", "Celsius", "Kelvin"], "answer": 1},
    {"question": LONG_CONTEXT, "choices": ["Buenos Aires", "Rio de Janeiro", "Santiago de Chile"], "answer": 0},
]
TASK_YAML = f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files: {{DATA}}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def lm_eval_run(server, tokenizer_folder, offline_env, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("lm-eval")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "tasks").mkdir()
    (folder / "tasks" / f"{TASK}.yaml").write_text(TASK_YAML.replace("{DATA}", str(data)))
    # tokenizer_backend given: lm-eval's auto detection would probe /tokenizer_info first.
    model_args = (f"base_url={server.url}/v1/completions,model={DEFAULT_MODEL},tokenizer={tokenizer_folder},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    out = folder / "out.json"
    env = {**offline_env, "HF_DATASETS_CACHE": str(folder / "datasets-cache")}
    run = subprocess.run([sys.executable, str(DRIVER), model_args, TASK, str(folder / "tasks"), str(out)],
                         cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"lm-eval failed:\n{run.stderr[-6000:]}\nserver log:\n{server.log()[-4000:]}"
    return json.loads(out.read_text())


def test_the_run_completes_with_an_accuracy(lm_eval_run):
    results = lm_eval_run["results"]
    assert results["sample_len"] == len(DOCS)
    assert isinstance(results["acc,none"], float) and 0 <= results["acc,none"] <= 1
    assert [s["doc_id"] for s in lm_eval_run["samples"]] == list(range(len(DOCS)))


def test_every_loglikelihood_equals_the_offline_engines(lm_eval_run, smollm2):
    requests = [r for sample in lm_eval_run["samples"] for r in sample["requests"]]
    assert len(requests) == sum(len(doc["choices"]) for doc in DOCS)
    assert max(len(r["context_ids"]) for r in requests) > 32       # two whole pages of the default page size
    assert max(len(r["continuation_ids"]) for r in requests) > 1
    outputs = smollm2.generate([r["context_ids"] + r["continuation_ids"] for r in requests],
                               SamplingParams(max_tokens=0, prompt_logprobs=0))
    for request, output in zip(requests, outputs):
        scored = output.prompt_logprobs[len(request["context_ids"]):]
        assert [p.token_id for p in scored] == request["continuation_ids"]
        assert math.isfinite(request["loglikelihood"])
        assert request["loglikelihood"] == pytest.approx(sum(p.logprob for p in scored), abs=1e-4), request
        assert request["is_greedy"] == all(p.rank == 1 for p in scored), request


def test_the_accuracy_is_the_offline_choice(lm_eval_run):
    """acc of a document: its answer has the highest loglikelihood (checked above to be the engine's)."""
    for sample, doc in zip(lm_eval_run["samples"], DOCS):
        lls = [r["loglikelihood"] for r in sample["requests"]]
        assert sample["acc"] == float(lls.index(max(lls)) == doc["answer"]), sample
    accs = [s["acc"] for s in lm_eval_run["samples"]]
    assert lm_eval_run["results"]["acc,none"] == pytest.approx(sum(accs) / len(accs))
