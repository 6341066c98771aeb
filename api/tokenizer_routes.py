"""vLLM's tokenizer routes: /tokenize, /detokenize, /tokenizer_info and /version."""
import importlib.metadata
import json
from typing import Any, TypeVar, cast

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ValidationError

from slora.api.context import ServerContext
from slora.api.errors import bad_request, invalid_request
from slora.api.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from slora.api.response_models import Detokenized, Tokenized, TokenizerInfo, Version
from slora.api.tenants import Tenant
from slora.api.tokenizing import encode_text

TModel = TypeVar("TModel", bound=BaseModel)


def slora_version() -> str:
    try:
        return importlib.metadata.version("slora")
    except importlib.metadata.PackageNotFoundError:     # run from a tree that is not installed
        return "0+unknown"


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object")
    return value


def _validated(model: type[TModel], value: dict[str, Any]) -> TModel:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None


def add_tokenizer_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:  # noqa: ANN401 - a dependency
    """/tokenize, /detokenize, /tokenizer_info and /version, as vLLM serves them (lm-eval's remote tokenizer
    uses the first three). Behind a key like the generation routes, with their limits; tokenizer work runs on
    their tokenizer threads. They parse their bodies by hand (a prompt or chat messages), so api/openapi.py
    documents the bodies."""
    def tokenizer() -> Any:  # noqa: ANN401 - a Hugging Face tokenizer
        ctx.require_engine()
        assert ctx.engine.info is not None, "require_engine() refuses the request before the engine is up"
        if ctx.engine.info.tokenizer is None:
            raise bad_request("this model has no tokenizer", param="model")
        return ctx.engine.info.tokenizer

    @app.post("/tokenize", response_model_exclude_unset=True)
    async def tokenize(request: Request, tenant: Tenant = Depends(caller)) -> Tokenized:
        source = tokenizer()
        value = _json_object(await request.body())
        if "messages" in value:
            return await _tokenize_chat(ctx, tenant, source, _validated(TokenizeChatRequest, value))
        return await _tokenize_prompt(ctx, tenant, source, _validated(TokenizeRequest, value))

    @app.post("/detokenize")
    async def detokenize(request: Request, tenant: Tenant = Depends(caller)) -> Detokenized:
        source = tokenizer()
        body = _validated(DetokenizeRequest, _json_object(await request.body()))
        if body.model is not None:
            await ctx.generation.require_model(body.model, tenant)
        assert ctx.engine.info is not None, "tokenizer() checked that the engine is up"
        tokens = _within_vocabulary(body.tokens, ctx.engine.info.vocab_size)
        text = await ctx.tokenization.run(tenant.id, source, lambda own, _: own.decode(tokens))
        return Detokenized(prompt=text)

    @app.get("/tokenizer_info")
    async def tokenizer_info(tenant: Tenant = Depends(caller)) -> TokenizerInfo:
        source = tokenizer()
        assert ctx.engine.info is not None, "tokenizer() checked that the engine is up"
        return TokenizerInfo(tokenizer_class=type(source).__name__, model_max_length=ctx.engine.info.max_model_len,
                             vocab_size=ctx.engine.info.vocab_size,
                             **{name: getattr(source, name, None) for name in ("bos_token", "eos_token", "pad_token",
                                                                               "unk_token", "chat_template")})

    @app.get("/version")
    async def version(tenant: Tenant = Depends(caller)) -> Version:
        return Version(version=slora_version())


async def _tokenize_prompt(ctx: ServerContext, tenant: Tenant, source: Any,  # noqa: ANN401
                           body: TokenizeRequest) -> Tokenized:
    if body.model is not None:
        await ctx.generation.require_model(body.model, tenant)
    if len(body.prompt) > ctx.settings.max_prompt_chars:
        raise bad_request(f"prompt has {len(body.prompt)} characters; the limit is "
                          f"{ctx.settings.max_prompt_chars} per request (max_prompt_chars)", param="prompt",
                          code="request_too_large")
    prompt, specials = body.prompt, body.add_special_tokens
    ids = await ctx.tokenization.run(tenant.id, source, lambda own, _: encode_text(own, prompt, specials))
    return await _tokenized(ctx, tenant, source, ids, bool(body.return_token_strs))


async def _tokenize_chat(ctx: ServerContext, tenant: Tenant, source: Any,  # noqa: ANN401
                         chat: TokenizeChatRequest) -> Tokenized:
    """The ids exactly as /v1/chat/completions would run them: its checks and its rendering."""
    if chat.model is None:           # the base model, as the chat route would answer for it
        chat.model = ctx.generation.base_names[0]
    else:
        await ctx.generation.require_model(chat.model, tenant)
    ctx.generation.check_request(chat, 1, chat.text_chars, "messages")
    ids = await ctx.generation.chat_prompt(chat, tenant)
    return await _tokenized(ctx, tenant, source, ids, bool(chat.return_token_strs))


def _within_vocabulary(tokens: list[int], vocab: int) -> list[int]:
    """The tokens, or a 400 naming the first id outside [0, vocab) and how many there are."""
    outside = [token for token in tokens if token >= vocab]
    if outside:
        raise bad_request(f"tokens: token id {outside[0]} is outside the vocabulary [0, {vocab})"
                          + (f" ({len(outside)} such ids)" if len(outside) > 1 else ""), param="tokens")
    return tokens


async def _tokenized(ctx: ServerContext, tenant: Tenant, source: Any, ids: list[int],  # noqa: ANN401
                     token_strs: bool) -> Tokenized:
    assert ctx.engine.info is not None, "the tokenizer routes run once the engine is up"
    answer = Tokenized(count=len(ids), max_model_len=ctx.engine.info.max_model_len, tokens=ids)
    if token_strs:
        # A Hugging Face tokenizer's method, which the pool's Tokenizer protocol does not name.
        answer.token_strs = await ctx.tokenization.run(
            tenant.id, source, lambda own, _: list(cast(Any, own).convert_ids_to_tokens(ids)))
    return answer
