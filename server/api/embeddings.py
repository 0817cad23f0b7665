"""OpenAI's embeddings endpoint (POST /v1/embeddings) on the engine's prompt pass.

Each input is prefilled like any prompt (its KV blocks shared through the prefix cache) and its last token's
hidden state after the model's final norm comes back instead of a token: last-token pooling, the pooling
decoder-based embedding models are trained for (Qwen3-Embedding, e5-mistral, gte-Qwen) and vLLM's default for
them; then L2-normalised (`normalize: false` keeps it raw), cut to `dimensions` (normalised again), and sent
as floats or base64 of little-endian float32, as OpenAI sends them.
"""

from __future__ import annotations

import base64

import torch
from fastapi import Request

from server.api.errors import APIError
from server.api.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, prompt_list
from server.api.serving import OpenAIServing


class EmbeddingsAPI:
    """POST /v1/embeddings through an OpenAIServing's engine and tokenizer."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        adapter = self.serving.check_model(req.model)
        self.serving.check_fields(req)
        prompts = prompt_list(req.input)
        if not prompts:
            raise APIError(400, "input must not be empty", param="input")
        vectors, num_tokens = await self.states(prompts, req.add_special_tokens, req.truncate_prompt_tokens, raw,
                                                f"embd-{raw.state.request_id}", adapter)
        if req.dimensions is not None and req.dimensions > vectors.shape[1]:
            raise APIError(400, f"dimensions {req.dimensions} is more than the model's {vectors.shape[1]}",
                           param="dimensions")
        if req.dimensions is not None:
            vectors = vectors[:, :req.dimensions]
        if req.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return EmbeddingResponse(model=self.serving.reply_model(req.model),
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
                                 data=[Embedding(index=i, embedding=_encoded(v, req.encoding_format))
                                       for i, v in enumerate(vectors)])


    async def states(self, prompts: list[str | list[int]], add_special_tokens: bool, truncate: int | None,
                     raw: Request, rid: str, adapter: str | None) -> tuple[torch.Tensor, int]:
        """The prompts' last hidden states [len(prompts), hidden] (fp32, not normalised) and their token count; a
        400 where this backend returns none."""
        if not self.serving.serves_embeddings:
            raise APIError(400, "this backend returns no embeddings (the torch backend does)", param="input",
                           code="embeddings_not_supported")
        states, num_tokens = await self.serving.last_hidden_states(prompts, add_special_tokens, truncate, raw, rid,
                                                                   adapter)
        return torch.tensor(states, dtype=torch.float32), num_tokens


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
