"""vLLM's score and rerank endpoints for an embedding model: POST /score (/v1/score) and POST /rerank (/v1/rerank,
/v2/rerank, the Jina and Cohere shape RAG frameworks call).

Each text is embedded as POST /v1/embeddings embeds it (the prompt pass's last hidden state) and a pair's score is the
cosine similarity of its two embeddings, as vLLM scores with an embedding model. A model trained as a cross-encoder
(a reranker that reads query and document together) would score differently; this server serves none.
"""

from __future__ import annotations

import time
import uuid

import torch
from fastapi import Request
from pydantic import BaseModel, Field, model_validator

from server.api.embeddings import EmbeddingsAPI
from server.api.errors import APIError
from server.api.protocol import RequestPart


class ScoreRequest(RequestPart):
    """POST /score: text_1 against each text_2 (one against many), or the lists pair by pair."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="score each text's last k tokens")
    user: str | None = None

    @model_validator(mode="after")
    def _check(self):
        first, second = _texts(self.text_1), _texts(self.text_2)
        if not first or not second:
            raise ValueError("text_1 and text_2 must not be empty")
        for name, texts in (("text_1", first), ("text_2", second)):
            if not all(texts):  # (checked here: the embedding pass would name its own field, `input`)
                raise ValueError(f"{name} must not hold an empty text")
        if len(first) > 1 and len(first) != len(second):
            raise ValueError(f"text_1 ({len(first)} texts) and text_2 ({len(second)}) pair one by one: give them "
                             "the same length, or text_1 one text")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        first, second = _texts(self.text_1), _texts(self.text_2)
        return list(zip(first * len(second) if len(first) == 1 else first, second))


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"score-{uuid.uuid4().hex}")
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(RequestPart):
    """POST /rerank: the documents ordered by their relevance to the query, the top_n best (all: absent or 0)."""

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = Field(True, description="Cohere's: each result carries its document's text")
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    user: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if not self.query or not all(self.documents):
            raise ValueError("query and documents must not hold an empty text")
        return self


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class ScoringAPI:
    """POST /score and /rerank on the embeddings' prompt pass."""

    def __init__(self, embeddings: EmbeddingsAPI):
        self.embeddings = embeddings
        self.serving = embeddings.serving

    async def _similarities(self, model: str | None, pairs: list[tuple[str, str]], truncate: int | None,
                            raw: Request, prefix: str) -> tuple[list[float], int]:
        """Each pair's cosine similarity, every distinct text embedded once; and the texts' token count."""
        adapter = self.serving.check_model(model)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        states, num_tokens = await self.embeddings.states(texts, True, truncate, raw,
                                                          f"{prefix}-{raw.state.request_id}", adapter)
        vectors = dict(zip(texts, torch.nn.functional.normalize(states, dim=-1)))
        return [float(vectors[a] @ vectors[b]) for a, b in pairs], num_tokens

    async def score(self, req: ScoreRequest, raw: Request) -> ScoreResponse:
        self.serving.check_fields(req)
        scores, num_tokens = await self._similarities(req.model, req.pairs(), req.truncate_prompt_tokens, raw, "score")
        return ScoreResponse(model=self.serving.reply_model(req.model),
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def rerank(self, req: RerankRequest, raw: Request) -> RerankResponse:
        self.serving.check_fields(req)
        if any(not document for document in req.documents):
            raise APIError(400, "documents must not hold an empty text", param="documents")
        scores, num_tokens = await self._similarities(req.model, [(req.query, d) for d in req.documents],
                                                      req.truncate_prompt_tokens, raw, "rerank")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        return RerankResponse(model=self.serving.reply_model(req.model), usage=RerankUsage(total_tokens=num_tokens),
                              results=[RerankResult(index=i, relevance_score=scores[i],
                                                    document=RerankDocument(text=req.documents[i])
                                                    if req.return_documents else None) for i in order])
