"""The offline API (DESIGN §6): `LLM(...).generate(prompts, params, adapters=...)`."""
import itertools
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from slora.config import engine_config
from slora.core.outputs import RequestOutput
from slora.engine import Engine
from slora.sampling.params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import TypeIs

Prompt = str | list[int]
Conversation = Seq[dict[str, str]]          # [{"role": "user", "content": "..."}, ...]


class LLM:
    """Offline batched generation over the engine. Keyword arguments are those of EngineConfig, and those
    of its CudaConfig (`gpu_memory_utilization=0.5` for `cuda=CudaConfig(gpu_memory_utilization=0.5)`)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = engine_config(model=model, **kwargs)
        self.engine = Engine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase | None":
        """The model's tokenizer (None: the model folder has none, and prompts must be token ids)."""
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str) -> str:
        """Load a PEFT folder under `name`; returns its version (content hash)."""
        return self.engine.adapters.load(name, path).version

    def unload_adapter(self, name: str) -> None:
        self.engine.adapters.unload(name)

    def pool_stats(self) -> dict[str, int]:
        return self.engine.pool_stats()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if it has any (an engine of one needs no closing)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 adapters: Seq[str | None] | None = None, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one output per prompt, in order. A request the
        engine failed alone (its adapter's files became unreadable, or a fault while handling it) comes back
        with finish_reason "error" and `.error` saying why; the others are unaffected. `priority`: one per
        prompt, lower admitted first (needs scheduling_policy "priority" or "vtc"), as vLLM's."""
        prompts = self._as_prompt_list(prompts)
        params_list = self._broadcast(params or SamplingParams(), len(prompts), "params")
        adapter_list = self._broadcast(adapters, len(prompts), "adapters") if adapters is not None \
            else [None] * len(prompts)
        priorities = self._broadcast(list(priority), len(prompts), "priority") if priority is not None \
            else [0] * len(prompts)
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            self._submit_all(zip(prompts, params_list, adapter_list, priorities), ids, finished)
            while self.engine.has_unfinished():
                self._step(finished)
        finally:                                 # a bad prompt, or an interrupt: nothing stays queued
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort(request_id)
        return [finished[i] for i in ids]

    def chat(self, conversations: Conversation | Seq[Conversation], params: SamplingParams | Seq[SamplingParams] |
             None = None, adapters: Seq[str | None] | None = None) -> list[RequestOutput]:
        """Reply to every conversation: each is rendered by the model's own chat template, with the prompt of
        the assistant's turn, then generated as `generate` does."""
        if _is_conversation(conversations):
            conversations = [conversations]
        return self.generate([self.chat_prompt_ids(c) for c in conversations], params, adapters)

    def chat_prompt_ids(self, conversation: Conversation) -> list[int]:
        """A conversation's prompt under the model's chat template, encoded as the server encodes it: the
        template writes the special tokens itself."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model has no chat template: use generate with prompt text")
        text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _submit_all(self, requests: Iterable[tuple[Prompt, SamplingParams, str | None, int]], ids: list[str],
                    finished: dict[str, RequestOutput]) -> None:
        """Queue the requests in order (their ids into `ids`). Once a full step's prompt tokens are queued,
        that step is launched before the rest are added: with overlapped scheduling the GPU runs it while
        the host validates and hashes the other prompts, instead of waiting for all of them."""
        queued, launched = 0, False
        for prompt, params, adapter, priority in requests:
            token_ids = self.encode(prompt)
            ids.append(self._submit(token_ids, params, adapter, priority))
            queued += len(token_ids)
            if not launched and queued >= self.config.step_tokens:
                self._step(finished)
                launched = True

    def _step(self, finished: dict[str, RequestOutput]) -> None:
        """One engine step; the requests it ended into `finished`."""
        finished.update({o.request_id: o for o in self.engine.step()})

    def _submit(self, token_ids: list[int], params: SamplingParams, adapter: str | None, priority: int = 0) -> str:
        request_id = f"offline-{next(self._ids)}"
        self.engine.add_request(request_id, token_ids, params, adapter, stream=False, priority=priority)
        return request_id

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    @staticmethod
    def _broadcast(value: object, count: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ValueError(f"{name}: got {len(value)} entries for {count} prompts")
            return list(value)
        return [value] * count


def _is_conversation(value: Conversation | Seq[Conversation]) -> "TypeIs[Conversation]":
    """One conversation (its messages are dicts), not a list of them."""
    return bool(value) and isinstance(value[0], dict)
