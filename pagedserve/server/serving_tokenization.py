"""``POST /tokenize`` and ``POST /detokenize`` as vLLM has them: clients count tokens, or
check a chat template's rendering, without generating."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedserve.server.serving_chat import render_chat
from pagedserve.server.serving_models import ServedModel, ServingModels


@dataclass
class TokenizationServing:
    models: ServingModels

    async def tokenize(self, body: dict) -> Response:
        request = _tokenize_request(body)
        model = self.models.resolve(request.model).model
        return await model.off_loop(_tokenize, model, request)

    async def detokenize(self, request: DetokenizeRequest) -> Response:
        model = self.models.resolve(request.model).model
        return await model.off_loop(_detokenize, model, request)


def _tokenize(model: ServedModel,
              request: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
    if isinstance(request, TokenizeChatRequest):
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
        text = render_chat(model, request.messages, tools, request.template_options())
    else:
        text = request.prompt
    tokens = model.encode(text, add_special_tokens=request.add_special_tokens)
    strs = model.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return _json(TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len,
                                  tokens=tokens, token_strs=strs))


def _detokenize(model: ServedModel, request: DetokenizeRequest) -> Response:
    vocab = len(model.tokenizer)
    bad = [t for t in request.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                          param="tokens")
    return _json(DetokenizeResponse(prompt=model.decode(request.tokens)))


def _tokenize_request(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's two requests, told apart by ``messages``: validating the body as their union
    would report each member's errors, named by the member's class instead of the field."""
    kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc


def _json(response: BaseModel) -> Response:
    # Serialized here, off the event loop: FastAPI's encoder takes seconds on a million ids.
    return Response(response.model_dump_json(exclude_none=True), media_type="application/json")
