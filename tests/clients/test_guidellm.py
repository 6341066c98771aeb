"""guidellm, a load generator, against `slora serve`: streamed chat completions from synthetic prompts,
two at a time, with what guidellm always sends (`stream_options.continuous_usage_stats`, `ignore_eos`) and
`min_tokens` as an extra body field. Bounded: four requests of six tokens, a duration cap and a timeout. With
`ignore_eos` every answer runs to max_tokens anyway, so this shows min_tokens accepted, not acting; that it acts is
tests/api/test_request_fields.py's test_min_tokens_holds_back_an_eos_the_model_wants.

Needs guidellm (in the dev extras). By hand: `pip install guidellm`, then `pytest tests/clients/test_guidellm.py`."""
import json
import subprocess
import sys

import pytest

from slora.models.builtin import DEFAULT_MODEL

pytest.importorskip("guidellm", reason="guidellm is not installed: pip install guidellm")

REQUESTS = 4
OUTPUT_TOKENS = 6
TIMEOUT_S = 300         # a guard against a hang, not a speed check: the run takes 30-60 s on 2 cores


@pytest.fixture(scope="module")
def report(server, tokenizer_folder, offline_env, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("guidellm")
    out = folder / "benchmarks.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": server.url, "model": DEFAULT_MODEL,
                    "request_format": "/v1/chat/completions", "timeout": 120, "http2": False,
                    "extras": {"body": {"min_tokens": OUTPUT_TOKENS}}},
        "profile": {"kind": "concurrent", "streams": 2},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_folder)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 16, "output_tokens": OUTPUT_TOKENS}],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}, {"kind": "max_duration", "seconds": 120}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}
    (folder / "scenario.json").write_text(json.dumps(scenario))
    run = subprocess.run([sys.executable, "-m", "guidellm", "run", "--scenario", str(folder / "scenario.json"),
                          "--disable-console-interactive"], cwd=folder, env=offline_env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"guidellm failed:\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_every_request_succeeds(report, server):
    [benchmark] = report["benchmarks"]
    requests = benchmark["requests"]
    errors = [r["info"]["error"] for r in requests["errored"] + requests["incomplete"]]
    assert not errors, f"{errors}\nserver log:\n{server.log()[-4000:]}"
    assert len(requests["successful"]) == REQUESTS
    assert benchmark["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                      "total": REQUESTS}


def test_the_requests_streamed_with_usage_and_min_tokens(report, smollm2):
    for request in report["benchmarks"][0]["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        [message] = body["messages"]
        [part] = message["content"]                     # guidellm sends the prompt as one text part
        assert body["stream"] and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["min_tokens"] == OUTPUT_TOKENS and body["max_completion_tokens"] == OUTPUT_TOKENS
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        assert request["info"]["timings"]["token_iterations"] == OUTPUT_TOKENS      # one token per chunk
        # The counts are the server's usage: the prompt with its chat template, the tokens streamed.
        prompt_ids = smollm2.chat_prompt_ids([{"role": "user", "content": part["text"]}])
        assert request["input_metrics"]["text_tokens"] == len(prompt_ids)
