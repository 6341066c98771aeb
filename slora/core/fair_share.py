"""How much of the engine each tenant has had: a virtual token counter per tenant (VTC, Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024), charged as the scheduler hands the service out.

A tenant's counter grows by `prompt_cost` per prompt token computed (a chunk at a time; tokens read from the
prefix cache and tokens recomputed after a preemption cost nothing), `output_cost` per token generated, and,
for an adapter brought into the pool for it, the prompt tokens its pages could have held, each divided by the
tenant's weight. Under the `vtc` policy the waiting tenant with the smallest counter is admitted next
(slora.core.waiting), and a tenant that starts waiting again is first lifted to the smallest counter of those
waiting: idle time earns no credit.
"""
import math
from dataclasses import dataclass, field

Tenant = str | None          # None: requests that name no tenant, counted as one client


@dataclass
class Account:
    """One tenant's service: the weighted counter that orders admission, and the tokens behind it."""

    weight: float = 1.0
    counter: float = 0.0         # weighted service charged so far
    prompt_tokens: int = 0       # prompt tokens computed for it (cache hits and recomputation not counted)
    output_tokens: int = 0       # tokens generated for it
    adapter_pages: int = 0       # pool pages its adapters were brought into


@dataclass(frozen=True)
class TenantShare:
    """An account as the server publishes it (a copy: the engine thread goes on charging its own)."""

    weight: float
    counter: float
    prompt_tokens: int
    output_tokens: int
    adapter_pages: int


@dataclass
class FairShare:
    prompt_cost: float = 1.0
    output_cost: float = 2.0
    page_size: int = 16
    accounts: dict[Tenant, Account] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("prompt_cost", "output_cost"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")

    def account(self, tenant: Tenant) -> Account:
        account = self.accounts.get(tenant)
        if account is None:
            account = self.accounts[tenant] = Account()
        return account

    def counter(self, tenant: Tenant) -> float:
        account = self.accounts.get(tenant)
        return 0.0 if account is None else account.counter

    def set_weight(self, tenant: Tenant, weight: float) -> None:
        """The tenant's share: a tenant of weight 2 gets twice the service of one of weight 1 while both wait."""
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"a tenant's weight must be a positive number, got {weight}")
        self.account(tenant).weight = weight

    def charge(self, tenant: Tenant, prompt_tokens: int, output_tokens: int) -> None:
        account = self.account(tenant)
        account.prompt_tokens += prompt_tokens
        account.output_tokens += output_tokens
        account.counter += (self.prompt_cost * prompt_tokens + self.output_cost * output_tokens) / account.weight

    def charge_adapter(self, tenant: Tenant, num_pages: int) -> None:
        """An adapter brought into the pool for the tenant costs what its pages' tokens would as a prompt."""
        account = self.account(tenant)
        account.adapter_pages += num_pages
        account.counter += self.prompt_cost * num_pages * self.page_size / account.weight

    def lift(self, tenant: Tenant, floor: float) -> None:
        """A tenant that starts waiting again starts no lower than `floor`: idling earns no credit."""
        account = self.account(tenant)
        account.counter = max(account.counter, floor)

    def shares(self) -> dict[Tenant, TenantShare]:
        return {tenant: TenantShare(a.weight, a.counter, a.prompt_tokens, a.output_tokens, a.adapter_pages)
                for tenant, a in self.accounts.items()}
