"""``POST /tokenize`` and ``POST /detokenize`` as vLLM has them: clients count tokens, or
check a chat template's rendering, without generating."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedserve.server.serving_chat import render_chat
from pagedserve.server.serving_models import ServedModel


@dataclass
class TokenizationServing:
    model: ServedModel

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest
                 ) -> TokenizeResponse:
        self.model.check_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
            text = render_chat(self.model, request.messages, tools,
                               request.add_generation_prompt)
        else:
            text = request.prompt
        tokens = self.model.encode(text, add_special_tokens=request.add_special_tokens)
        strs = self.model.tokenizer.convert_ids_to_tokens(tokens) \
            if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.model.max_model_len,
                                tokens=tokens, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.model.check_name(request.model)
        vocab = len(self.model.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                              param="tokens")
        return DetokenizeResponse(prompt=self.model.decode(request.tokens))
