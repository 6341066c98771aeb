"""The API's two-part adapter load (prepare on a worker thread, register on the engine thread) leaves the
engine exactly as `Engine.load_adapter` does, including a new version under a name while a request runs on
the old one."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from slora.adapters.errors import AdapterError
from slora.config import EngineConfig
from slora.engine import Engine
from slora.models.builtin import TINY_MODEL
from slora.sampling.params import SamplingParams


def state(engine: Engine) -> dict:
    return {"entries": dict(engine.adapters.names.entries),
            "store": {v: s.requests for v, s in engine.adapters.versions.items()},
            "resident": sorted(engine.adapters.resident), "pool": engine.pool_stats()}


def scenario(engine: Engine, load, adapter_root) -> list[dict]:
    snapshots = []
    load(engine, "a", adapter_root / "attn-r4")
    snapshots.append(state(engine))
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "a")
    engine.step()
    engine.step()
    load(engine, "a", adapter_root / "mlp-r8")            # new version while "r" runs on the old one
    snapshots.append(state(engine))
    outputs = []
    while engine.has_unfinished():
        outputs += [o.token_ids for o in engine.step() if o.finished]
    snapshots.append(state(engine))
    load(engine, "b", adapter_root / "mlp-r8", owner="acme", public=True)
    engine.adapters.unload("a")
    snapshots.append(state(engine))
    snapshots.append({"outputs": outputs})
    engine.check()
    return snapshots


def via_engine(engine, name, path, owner=None, public=False):
    engine.adapters.load(name, path, owner=owner, public=public)


def via_api(engine, name, path, owner=None, public=False):
    with ThreadPoolExecutor(1) as worker:                 # prepare off the engine thread, as the server does
        prepared = worker.submit(engine.adapters.prepare, path).result()
    engine.adapters.register(name, prepared, owner=owner, public=public)


def test_split_load_matches_engine_load(adapter_root):
    config = dict(num_pages=256)
    assert scenario(Engine(EngineConfig(TINY_MODEL, **config)), via_api, adapter_root) == \
        scenario(Engine(EngineConfig(TINY_MODEL, **config)), via_engine, adapter_root)


def test_prepare_refuses_and_leaves_nothing_behind(adapter_root, tmp_path):
    import json
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(adapter_root / "attn-r4", broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    engine = Engine(EngineConfig(TINY_MODEL, num_pages=256))
    before = state(engine)
    with ThreadPoolExecutor(1) as worker, pytest.raises(AdapterError, match="r: the LoRA rank"):
        worker.submit(engine.adapters.prepare, broken).result()
    assert state(engine) == before
    with pytest.raises(AdapterError, match="non-empty"):
        engine.adapters.register("", engine.adapters.prepare(adapter_root / "attn-r4"))
    assert state(engine) == before
