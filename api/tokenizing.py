"""A request's prompts as token ids: text prompts encoded, chat messages rendered by the chat template."""
import functools
import inspect
import logging
import re
import threading
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slora.api.errors import bad_request
from slora.api.protocol import ChatCompletionRequest
from slora.api.tokenizer_pool import Tokenization, TokenizationCancelled, Tokenizer

logger = logging.getLogger(__name__)
# Used when the tokenizer has no chat template (documented in the README): one block per message,
# "<|role|>\n{content}{eos}\n", then "<|assistant|>\n" to ask for the answer.
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PromptInput = str | list[str] | list[int] | list[list[int]]     # a completion's prompt, in any of its forms


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Text -> ids exactly as the offline `LLM.encode` does (by default), so both give the same tokens."""
    if not add_special_tokens:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_texts(tokenizer: Tokenizer, texts: list[str], cancelled: threading.Event,
                 add_special_tokens: bool = True) -> list[list[int]]:
    """Each prompt's ids; stops between prompts once `cancelled` is set."""
    ids = []
    for text in texts:
        if cancelled.is_set():
            raise TokenizationCancelled()
        ids.append(encode_text(tokenizer, text, add_special_tokens))
    return ids


def decode_prompts(tokenizer: Tokenizer, prompts: list[list[int]], cancelled: threading.Event) -> list[str]:
    """Each token-id prompt's text (for echo); stops between prompts once `cancelled` is set."""
    texts = []
    for prompt in prompts:
        if cancelled.is_set():
            raise TokenizationCancelled()
        texts.append(tokenizer.decode(prompt))
    return texts


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                **template_kwargs: Any) -> list[int]:   # noqa: ANN401 - the template's variables
    """The chat template's text of `messages`, as ids. `template_kwargs` (tools, documents, the request's
    chat_template_kwargs) are the template's; keys that are none of its variables are left out."""
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    extra = {key: value for key, value in template_kwargs.items() if value is not None}
    if continue_final_message:
        extra["continue_final_message"] = True
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    return encode_text(tokenizer, text, add_special_tokens)


def template_reserved_names(tokenizer: Tokenizer) -> frozenset[str]:
    """Names chat_template_kwargs may not use: the parameters of `apply_chat_template` itself (tokenize,
    chat_template, tools, ...), which would change how it runs rather than what the template sees."""
    return _reserved_names(type(tokenizer))


@functools.lru_cache(maxsize=16)
def _reserved_names(tokenizer_class: type[Tokenizer]) -> frozenset[str]:
    try:
        parameters = list(inspect.signature(tokenizer_class.apply_chat_template).parameters.values())
    except (AttributeError, TypeError, ValueError):
        parameters = []
    names = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names | {"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                              "continue_final_message", "tools", "documents", "return_dict", "tokenizer_kwargs"})


@functools.lru_cache(maxsize=16)
def template_reads_tools(template: str) -> bool:
    """Whether a chat template uses its `tools` variable. One that does not (SmolLM2's) renders the same prompt
    with and without a request's tools: the model never sees them. A template this parser cannot read (a
    tokenizer's own tags) counts as using them when it names them."""
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])   # as transformers'
    try:
        return "tools" in meta.find_undeclared_variables(environment.parse(template))
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", template) is not None


def warn_if_tools_unseen(tokenizer: Tokenizer, body: ChatCompletionRequest) -> None:
    """Log that the request's tools are lost when the chat template ignores them: the model cannot choose a tool it
    is not shown, and the client would otherwise see only answers without calls."""
    tools = body.template_tools()
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    if tools and isinstance(template, str) and not template_reads_tools(template):
        choice = body.effective_tool_choice()
        shown = "a named function" if choice is not None and not isinstance(choice, str) else choice or "auto"
        logger.warning("the chat template ignores `tools`: the request's %d tool(s) are not in its prompt, so the "
                       "model is never shown them and will not call one by itself (tool_choice %s); serving a "
                       "model whose chat template renders tools fixes this", len(tools), shown)


class PromptTokenizer:
    """One request's tokenizer work, on the pool's threads in its tenant's turn."""

    def __init__(self, pool: Tokenization, tokenizer: Tokenizer | None, tenant_id: str) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.tenant_id = tenant_id

    def require(self, what: str) -> Tokenizer:
        """The tokenizer, or a 400: a model without one takes token ids only."""
        if self.tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what} needs one; give prompts as token ids",
                              param="prompt" if what == "text prompts" else "messages")
        return self.tokenizer

    async def completion(self, prompt: PromptInput, add_special_tokens: bool = True) -> list[list[int]]:
        """Each prompt's ids: token ids as given, texts encoded."""
        texts = [prompt] if isinstance(prompt, str) else prompt
        if isinstance(texts[0], int):            # CompletionRequest refuses empty lists
            return [list(texts)]
        if isinstance(texts[0], list):
            return [list(p) for p in texts]
        return await self.pool.run(self.tenant_id, self.require("text prompts"),
                                   lambda own, cancelled: encode_texts(own, texts, cancelled, add_special_tokens))

    async def echo(self, prompt: PromptInput, prompts: list[list[int]]) -> list[str]:
        """The text each prompt's answers start with: the prompt as given, or decoded from its ids."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str):
            return [p for p in prompt if isinstance(p, str)]
        if self.tokenizer is None:
            return ["" for _ in prompts]
        return await self.pool.run(self.tenant_id, self.tokenizer,
                                   lambda own, cancelled: decode_prompts(own, prompts, cancelled))

    async def chat(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template's prompt of the request's messages; a 400 when the template refuses them."""
        tokenizer = self.require("chat")
        warn_if_tools_unseen(tokenizer, body)
        messages = [m.template_dict() for m in body.messages]
        variables: dict[str, Any] = {"tools": body.template_tools(), "documents": body.documents,
                                     "reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}
        try:
            return await self.pool.run(self.tenant_id, tokenizer, lambda own, _: render_chat(
                own, messages, body.add_generation_prompt, bool(body.continue_final_message),
                bool(body.add_special_tokens), **variables))
        except (ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") \
                from None
        except Exception as exc:       # jinja2 template errors (raise_exception in the template) are user errors
            if type(exc).__module__.startswith("jinja2"):
                raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None
            raise
