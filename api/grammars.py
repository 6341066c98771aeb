"""A job's structured output compiled on the grammar workers (off the engine's thread) before it is admitted."""
import asyncio
from typing import TYPE_CHECKING

from slora.api.async_engine import EngineInfo
from slora.api.errors import bad_request, rate_limited
from slora.api.settings import ServerSettings
from slora.sampling.grammar_service import GrammarLimitError, GrammarQueueFull, GrammarService
from slora.sampling.structured_output import StructuredOutput

if TYPE_CHECKING:
    from slora.sampling.grammar import CompiledGrammar


class GrammarCompiles:
    """The grammar workers, started by the first structured request, and each request's compile on them."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._grammars: GrammarService | None = None
        self._grammars_lock = asyncio.Lock()

    async def compile(self, info: EngineInfo, tenant_id: str, spec: StructuredOutput,
                      param: str | None) -> "CompiledGrammar":
        """`spec` compiled; a 400 naming the limit it passes (and `param`, the field that asked for it), a 429
        while the tenant has too many compiles pending. A client that leaves abandons it."""
        service = await self._grammar_service(info)
        try:
            future = service.submit(tenant_id, spec)
        except GrammarQueueFull as exc:
            raise rate_limited(str(exc), self.settings.retry_after_s) from None
        waiting = asyncio.wrap_future(future)
        # Read by nobody once this client leaves (the shield keeps the shared compile from being cancelled).
        waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            return await asyncio.shield(waiting)     # shared with the tenant's other waiters
        except asyncio.CancelledError:
            service.abandon(future)
            raise
        except GrammarLimitError as exc:
            raise bad_request(str(exc), param=param, code="grammar_too_complex") from None
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None

    async def _grammar_service(self, info: EngineInfo) -> GrammarService:
        """The compile workers, started on first use (the tokenizer's tables take a moment to build)."""
        async with self._grammars_lock:
            if self._grammars is None:
                if info.tokenizer is None:
                    raise bad_request("structured output needs the model's tokenizer, and this model has none")
                self._grammars = await asyncio.to_thread(GrammarService.for_tokenizer, info.tokenizer, info.vocab_size,
                                                         info.eos_token_ids, self.settings.compile_limits())
            return self._grammars

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()
