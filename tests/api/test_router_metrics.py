"""vLLM's router series on /metrics (num_requests_running/waiting, kv_cache_usage_perc, lora_requests_info, adapter
residency, the load histogram), on one real server with tenants: they move as requests run, and a scrape names only
the adapters its reader may see (an anonymous one none, a tenant never another tenant's)."""
import threading
import time

import httpx
import pytest
from conftest import BASE_MODEL, start_server, write_tenants
from prometheus_client.parser import text_string_to_metric_families

KEYS = {"ops": "router-ops-key", "acme": "router-acme-key", "globex": "router-globex-key"}
SECRET = "secret-acme"             # acme's adapter: no other tenant's scrape may contain the name
ROUTER_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:lora_adapter_loaded", "vllm:num_gpu_loaded_lora_adapters",
                 "vllm:num_cpu_loaded_lora_adapters", "vllm:max_gpu_lora_adapters", "vllm:lora_adapter_load_seconds")


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_root):
    """One batch seat (--max-num-seqs 1), so that concurrent requests queue; a public /metrics."""
    folder = tmp_path_factory.mktemp("router-metrics")
    tenants = write_tenants(folder, {"ops": {"key": KEYS["ops"], "role": "admin"}, "acme": {"key": KEYS["acme"]},
                                     "globex": {"key": KEYS["globex"]}})
    srv = start_server(folder, "--tenants", str(tenants), "--adapter-root", str(adapter_root), "--max-num-seqs", "1")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


class Scrape:
    """One /metrics answer: its text and its families, parsed by prometheus_client."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {family.name: family for family in text_string_to_metric_families(text)}

    def value(self, name: str) -> float:
        (sample,) = self.families[name].samples
        return sample.value

    def info(self) -> dict[str, str]:
        (sample,) = self.families["vllm:lora_requests_info"].samples
        return sample.labels

    def loaded(self) -> set[tuple[str, str, str]]:
        """(adapter_name, level, pinned) of the vllm:lora_adapter_loaded series."""
        samples = self.families["vllm:lora_adapter_loaded"].samples
        assert all(s.value == 1 and s.labels["model_name"] == BASE_MODEL for s in samples), samples
        return {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"]) for s in samples}

    def loads(self) -> float:
        return next(s.value for s in self.families["vllm:lora_adapter_load_seconds"].samples
                    if s.name.endswith("_count"))


def scrape(server, tenant: str | None) -> Scrape:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    response = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30, trust_env=False)
    assert response.status_code == 200, response.text
    return Scrape(response.text)


def poll(server, tenant: str | None, condition, what: str, timeout_s: float = 30.0) -> Scrape:
    deadline = time.monotonic() + timeout_s
    while True:
        current = scrape(server, tenant)
        if condition(current):
            return current
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{current.text}"
        time.sleep(0.05)


def load(server, tenant: str, name: str, path: str) -> None:
    with server.http(KEYS[tenant]) as http:
        response = http.post("/v1/adapters", json={"name": name, "path": path})
    assert response.status_code == 200, response.text


def complete(server, tenant: str, model: str, max_tokens: int) -> None:
    with server.client(KEYS[tenant]) as client:
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            pass


def assert_no_secret(scrapes: list[Scrape]) -> None:
    for current in scrapes:
        assert SECRET not in current.text and "acme/" not in current.text, current.text


def test_series_parse_at_rest_and_anonymous_scrapes_name_nothing(server):
    anonymous = scrape(server, None)
    assert set(ROUTER_SERIES) <= set(anonymous.families)
    assert anonymous.value("vllm:num_requests_running") == 0 and anonymous.value("vllm:num_requests_waiting") == 0
    assert 0 <= anonymous.value("vllm:kv_cache_usage_perc") <= 1
    assert anonymous.value("vllm:max_gpu_lora_adapters") == 1                    # max_loras unset: max_num_seqs
    assert anonymous.info() == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"}
    assert abs(anonymous.families["vllm:lora_requests_info"].samples[0].value - time.time()) < 600
    assert anonymous.loaded() == set()                         # the demo adapters are in host memory, unnamed
    assert anonymous.value("vllm:num_cpu_loaded_lora_adapters") >= 3 and anonymous.loads() >= 3
    admin = scrape(server, "ops")
    assert {("demo-r4-attn", "cpu", "false"), ("demo-r8-mlp", "cpu", "false")} <= admin.loaded()
    assert admin.value("vllm:num_gpu_loaded_lora_adapters") == 0


def test_values_move_while_requests_run_and_names_stay_with_their_tenant(server):
    loads = scrape(server, None).loads()
    load(server, "acme", SECRET, "attn-r4")
    load(server, "globex", "globex-bot", "mlp-r8")
    assert scrape(server, None).loads() == loads + 2                   # two new versions into host memory
    threads = [threading.Thread(target=complete, args=(server, "acme", SECRET, 160)) for _ in range(3)]
    for thread in threads:
        thread.start()
    admin = poll(server, "ops", lambda s: s.value("vllm:num_requests_running") == 1
                 and s.value("vllm:num_requests_waiting") >= 1 and s.info()["running_lora_adapters"] == f"acme/{SECRET}"
                 and s.info()["waiting_lora_adapters"] == f"acme/{SECRET}", "one running, the others waiting")
    assert (f"acme/{SECRET}", "gpu", "true") in admin.loaded() and admin.value("vllm:kv_cache_usage_perc") > 0
    assert admin.value("vllm:num_gpu_loaded_lora_adapters") >= 1
    own = poll(server, "acme", lambda s: s.info()["running_lora_adapters"] == SECRET, "acme's own running adapter")
    assert (SECRET, "gpu", "true") in own.loaded() and ("globex-bot", "cpu", "false") not in own.loaded()
    others = [scrape(server, tenant) for tenant in ("globex", None, "globex", None)]
    assert others[0].value("vllm:num_requests_running") == 1 and others[0].info()["running_lora_adapters"] == ""
    for thread in threads:
        thread.join(timeout=120)
    idle = poll(server, "ops", lambda s: s.value("vllm:num_requests_running") == 0
                and s.value("vllm:num_requests_waiting") == 0, "the batch to drain")
    assert (f"acme/{SECRET}", "gpu", "false") in idle.loaded() and idle.info()["running_lora_adapters"] == ""
    assert_no_secret(others + [scrape(server, "globex"), scrape(server, None)])


def test_a_tenant_sees_its_own_adapters_and_the_public_ones_it_ran(server):
    before = scrape(server, "globex")
    assert ("globex-bot", "cpu", "false") in before.loaded()        # its own, loaded first by it
    assert not {name for name, _, _ in before.loaded()} & {"demo-r4-attn", "demo-r8-mlp", "demo-r16-all"}
    complete(server, "globex", "demo-r4-attn", 2)
    after = poll(server, "globex", lambda s: ("demo-r4-attn", "gpu", "false") in s.loaded(), "the public adapter")
    assert_no_secret([after])


def test_a_key_sent_to_the_public_metrics_must_be_valid(server):
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer not-a-key"}, timeout=30,
                         trust_env=False)
    assert response.status_code == 401
