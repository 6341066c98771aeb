"""Per-tenant seats are sequences in the engine's batch (prompts × samples of a request), not HTTP requests; and
the tenants file's `weight`."""
import asyncio

import pytest

from slora.api.errors import APIError
from slora.api.jobs import Job
from slora.api.limits import Admission
from slora.api.tenants import Tenant, hash_key, load_tenants
from slora.sampling.params import SamplingParams


def job_of(prompts: int, **sampling: int) -> Job:
    return Job(kind="completion", model="m", adapter=None, tenant=Tenant("t"), prompts=[[1, 2]] * prompts,
               params=SamplingParams(**sampling), stream=False, include_usage=False, return_token_ids=False, user=None)


async def waiting(admission: Admission, tenant: Tenant, seats: int) -> asyncio.Task:
    """A request of `seats` that has reached admission (and waits there unless its seats are free)."""
    task = asyncio.ensure_future(admission.acquire(tenant, seats))
    await settle()
    return task


async def settle() -> None:
    """Let woken tasks run to their next wait."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_job_holds_prompts_times_samples_seats():
    assert job_of(2, n=2).seats == 4
    assert job_of(1).seats == 1
    assert job_of(3, n=2, best_of=3).seats == 9                   # best_of samples run, n are returned


def test_a_two_prompt_n2_request_holds_four_seats_and_the_next_waits():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=5, max_queued=5)
        await admission.acquire(acme, job_of(2, n=2).seats)
        second = await waiting(admission, acme, 2)                # 4 + 2 > 5: as a request count it would fit
        assert not second.done() and admission.queued == 1 and admission.pending == 2
        one = await waiting(admission, acme, 1)                   # 4 + 1 fits, but one waits ahead of it
        assert not one.done()
        admission.release(acme, 4)
        await settle()
        assert second.done() and one.done() and admission.queued == 0 and admission.pending == 2
        admission.release(acme, 2)
        admission.release(acme, 1)
        assert admission.pending == 0
        await admission.acquire(acme, 5)                          # every seat came back
    asyncio.run(scenario())


def test_a_request_over_max_concurrent_is_400_at_once():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=4, max_queued=100)
        with pytest.raises(APIError) as info:
            await admission.acquire(acme, 64)
        error = info.value
        assert error.status == 400 and error.code == "request_too_large" and error.param == "n"
        assert "64 sequences" in error.message and "at most 4 at once" in error.message
        assert "Retry-After" not in error.headers and admission.pending == 0 and admission.queued == 0
        await admission.acquire(acme, 4)                          # exactly the limit runs
    asyncio.run(scenario())


def test_queued_seats_over_max_queued_are_429():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=3)
        acme = Tenant("acme", max_concurrent=4, max_queued=4)
        await admission.acquire(acme, 4)
        three = await waiting(admission, acme, 3)
        with pytest.raises(APIError) as info:                     # 3 + 2 queued seats > 4
            await admission.acquire(acme, 2)
        assert info.value.status == 429 and info.value.headers["Retry-After"] == "3"
        assert "4 sequences running, 4 queued" in info.value.message
        one = await waiting(admission, acme, 1)                   # 3 + 1 still fits the queue
        assert not three.done() and not one.done() and admission.queued == 2
        admission.release(acme, 4)
        await settle()
        assert three.done() and one.done()
    asyncio.run(scenario())


def test_a_small_request_never_overtakes_a_big_waiter():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=4, max_queued=8)
        await admission.acquire(acme, 3)
        big = await waiting(admission, acme, 4)
        small = await waiting(admission, acme, 1)                 # its seat is free, but big came first
        assert not big.done() and not small.done()
        admission.release(acme, 3)
        await settle()
        assert big.done() and not small.done()                    # 4 running: no room for small yet
        admission.release(acme, 4)
        await settle()
        assert small.done() and admission.pending == 1
    asyncio.run(scenario())


def test_release_wakes_waiters_in_order_while_they_fit():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=4, max_queued=8)
        await admission.acquire(acme, 4)
        tasks = [await waiting(admission, acme, seats) for seats in (1, 1, 2, 3)]
        admission.release(acme, 4)
        await settle()
        assert [t.done() for t in tasks] == [True, True, True, False]
        assert admission.queued == 1 and admission.pending == 4
    asyncio.run(scenario())


def test_a_cancelled_big_waiter_wakes_the_small_ones_behind_it():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=4, max_queued=8)
        await admission.acquire(acme, 2)
        big = await waiting(admission, acme, 4)
        smalls = [await waiting(admission, acme, 1) for _ in range(3)]
        big.cancel()                                              # its client went away
        await asyncio.gather(big, return_exceptions=True)
        await settle()
        assert [t.done() for t in smalls] == [True, True, False]  # 2 + 1 + 1 = 4 running
        assert admission.queued == 1 and admission.pending == 4
    asyncio.run(scenario())


def test_a_waiter_cancelled_as_it_is_granted_gives_its_seats_to_the_next():
    async def scenario():
        admission = Admission(max_pending=10, retry_after_s=1)
        acme = Tenant("acme", max_concurrent=4, max_queued=8)
        await admission.acquire(acme, 4)
        first = await waiting(admission, acme, 3)
        second = await waiting(admission, acme, 2)
        admission.release(acme, 4)                                # hands 3 seats to first...
        first.cancel()                                            # ...whose client goes away before it runs
        await asyncio.gather(first, return_exceptions=True)
        await settle()
        assert first.cancelled() and second.done() and not second.cancelled()
        assert admission.pending == 1 and admission.queued == 0
        await admission.acquire(acme, 2)                          # 2 + 2: first's seats are not held
        assert admission.pending == 2
    asyncio.run(scenario())


def test_a_tenant_without_a_limit_never_waits_and_the_server_bound_counts_requests():
    async def scenario():
        admission = Admission(max_pending=2, retry_after_s=1)
        free = Tenant("free")
        await admission.acquire(free, 500)
        await admission.acquire(free, 500)
        with pytest.raises(APIError, match="capacity"):           # 2 requests, not 1000 sequences, are the bound
            await admission.acquire(free, 1)
        admission.release(free, 500)
        await admission.acquire(free, 1)
    asyncio.run(scenario())


def test_weight_in_the_tenants_file(tmp_path):
    path = tmp_path / "tenants.toml"
    head = f'[tenants.a]\nkey_sha256 = "{hash_key("k")}"\n'
    path.write_text(head)
    assert load_tenants(path).get("a").weight == 1.0
    for text, weight in (("2.0", 2.0), ("3", 3.0), ("0.25", 0.25)):
        path.write_text(head + f"weight = {text}\n")
        parsed = load_tenants(path).get("a").weight
        assert parsed == weight and isinstance(parsed, float)
    for text in ("0", "-1", "0.0", '"x"', "true", "inf", "nan", "[1]"):
        path.write_text(head + f"weight = {text}\n")
        with pytest.raises(ValueError, match=r"tenants\.a\.weight"):
            load_tenants(path)
    with pytest.raises(ValueError, match="weight"):
        Tenant("a", weight=0.0)
