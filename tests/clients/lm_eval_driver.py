"""Runs one lm-eval task through lm-eval's Python API, as a customer evaluating a fine-tune would, and writes what
the test needs as JSON. A separate process so that HF_HUB_OFFLINE / HF_DATASETS_OFFLINE hold from the first import
(huggingface_hub and datasets read them once, when imported; the test process has imported them long before).

usage: python lm_eval_driver.py MODEL_ARGS TASK INCLUDE_PATH OUT_JSON"""
import json
import sys

import lm_eval
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager


def main(model_args: str, task: str, include_path: str, out_path: str) -> None:
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                      task_manager=TaskManager(include_path=include_path, include_defaults=False),
                                      log_samples=True, bootstrap_iters=0)
    # The token ids the requests carried: lm-eval's own split of each (context, continuation) pair.
    lm = get_model("local-completions").create_from_arg_string(model_args)
    samples = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        requests = []
        for (context, continuation), (loglikelihood, is_greedy) in zip(sample["arguments"], sample["filtered_resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            requests.append({"context_ids": context_ids, "continuation_ids": continuation_ids,
                             "loglikelihood": loglikelihood, "is_greedy": is_greedy})
        samples.append({"doc_id": sample["doc_id"], "target": sample["target"], "acc": sample["acc"],
                        "requests": requests})
    with open(out_path, "w") as out:
        json.dump({"results": results["results"][task], "samples": samples}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
