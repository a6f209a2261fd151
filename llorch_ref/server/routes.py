"""The worker's routes: GET /health, GET /v1/models, POST /cancel, POST /tokenize, POST /execute (the
llm-worker-rbee API, SSE); and the OpenAI-compatible POST /v1/completions and /v1/chat/completions, streaming or not."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import logprobs
from .gateway import Gateway, sse
from .guard import error_response
from .schemas import (
    OPENAI_FINISH,
    STOP_REASONS,
    ChatRequest,
    CompletionRequest,
    ExecuteRequest,
    TokenizeRequest,
)

SSE_HEADERS = {"Cache-Control": "no-cache"}


def worker_routes(gw: Gateway) -> APIRouter:
    r = APIRouter()
    worker = gw.worker

    @r.get("/health")
    async def health():
        return {"status": "healthy", "model": gw.name, "backend": gw.engine.backend.name,
                "numerics": gw.engine.numerics, "state": worker.state, "queued": worker.pending,
                "max_queue": worker.max_queue, "served": worker.served, "cancelled": worker.cancelled,
                "tokens_out": worker.tokens_out, "tokens_after_client_left": worker.tokens_after_client_left}

    @r.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": gw.name, "object": "model", "created": 0,
                                            "owned_by": "llorch-ref"}]}

    @r.post("/cancel")
    async def cancel(body: dict):
        job_id = body.get("job_id") if isinstance(body, dict) else None
        if not isinstance(job_id, str) or not job_id or set(body) != {"job_id"}:
            return error_response(400, "INVALID_REQUEST", "body must be {\"job_id\": \"...\"}", {"job_id": "required"})
        if not worker.cancel(job_id):
            return error_response(404, "NO_SUCH_JOB", f"no queued or running job has job_id {job_id[:200]!r}")
        return JSONResponse({"job_id": job_id, "status": "cancelling"}, status_code=202)

    @r.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """llama-server's route: {"content"} -> {"tokens"}, the ids the OpenAI routes run on a raw prompt."""
        tok = gw.engine.tokenizer
        if tok is None:
            return error_response(400, "INVALID_REQUEST", "this model has no vocabulary: nothing to tokenize")
        return {"tokens": await asyncio.to_thread(tok.encode, req.content)}

    @r.post("/execute")
    async def execute(req: ExecuteRequest, request: Request):
        job, err = await gw.start(req, request, openai=False, job_id=req.job_id or uuid.uuid4().hex)
        if err:
            return err
        return StreamingResponse(_execute_events(gw, job), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, "X-Job-Id": job.job_id})
    return r


async def _execute_events(gw: Gateway, job):
    async for kind, p in gw.events(job):
        if kind == "started":
            yield sse({"type": "started", "job_id": job.job_id, "model": gw.name, "started_at": p["started_at"]})
        elif kind == "token":
            yield sse({"type": "token", "t": p["t"], "i": p["i"]})
        elif kind == "end":
            yield sse({"type": "end", "tokens_out": len(p.token_ids), "decode_time_ms": round(p.decode_s * 1000, 3),
                       "stop_reason": STOP_REASONS.get(p.stop_reason, "ERROR"),
                       "stop_sequence_matched": p.stop_sequence, "seed": p.seed})
        else:
            yield sse({"type": "error", **p})


def openai_routes(gw: Gateway) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _openai(gw, req, request, chat=False)

    @r.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await _openai(gw, req, request, chat=True)
    return r


class _OpenAIReply:
    """The shapes of one OpenAI response: its id, object names, choices and usage."""

    def __init__(self, gw: Gateway, chat: bool, include_usage: bool):
        self.chat, self.name, self.include_usage = chat, gw.name, include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = self.object + ".chunk" if chat else self.object

    def choice(self, text=None, finish=None, first=False):
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    @staticmethod
    def usage(res):
        return {"prompt_tokens": len(res.prompt_ids), "completion_tokens": len(res.token_ids),
                "total_tokens": len(res.prompt_ids) + len(res.token_ids)}

    def chunk(self, choices, **extra):
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.name,
                    "choices": choices, **({"usage": None} if self.include_usage else {}), **extra})


async def _openai(gw: Gateway, req, request: Request, chat: bool):
    include_usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
    reply = _OpenAIReply(gw, chat, include_usage)
    job, err = await gw.start(req, request, openai=True, job_id=reply.id)
    if err:
        return err
    headers = {"X-Job-Id": reply.id}
    if req.stream:
        return StreamingResponse(_openai_chunks(gw, job, reply), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    text, result = "", None
    async for kind, p in gw.events(job):
        if kind == "token":
            text += p["t"]
        elif kind == "end":
            result = p
        elif kind == "error":
            return error_response(500 if p["code"] == "INFERENCE_FAILED" else 400, p["code"], p["message"])
    if result.stop_reason == "cancelled":       # the client went away, or /cancel named this job
        return error_response(499, "CANCELLED", "cancelled: the client disconnected or the job was cancelled",
                              headers=headers)
    finish = OPENAI_FINISH[result.stop_reason]
    if not chat and req.echo:
        text = req.prompt + text
    ch = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
          if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    body = {"id": reply.id, "object": reply.object, "created": reply.created, "model": gw.name,
            "choices": [ch], "usage": reply.usage(result), "system_fingerprint": f"llorch-ref-seed-{result.seed}"}
    if job.logprobs is None:
        return JSONResponse(body, headers=headers)
    mark = f"logprobs-{uuid.uuid4().hex}"           # where the log-probabilities' JSON text goes
    ch["logprobs"] = mark
    lp = await asyncio.to_thread(_logprobs_json, gw, job, chat, 0 if chat or req.echo else len(req.prompt))
    data = json.dumps(body, ensure_ascii=False).replace(json.dumps(mark), lp, 1)
    return Response(data.encode(), media_type="application/json", headers=headers)


def _logprobs_json(gw: Gateway, job, chat: bool, offset0: int) -> str:
    """The job's log-probabilities as OpenAI's JSON (logprobs.py), in a thread: a whole vocabulary a step is
    seconds of work."""
    tj, tokens, res = gw.tokens_json(), job.result.token_ids, job.result
    logp = job.logp if job.logp is not None else np.zeros((0, tj.n_vocab))
    if chat:
        return logprobs.chat_json(logp, tokens, job.logprobs, tj)
    if job.echo:
        return logprobs.completion_json(logp, res.prompt_ids[1:] + list(tokens), job.logprobs, tj, offset0,
                                        echo_first=res.prompt_ids[0])
    return logprobs.completion_json(logp, tokens, job.logprobs, tj, offset0)


async def _openai_chunks(gw: Gateway, job, reply: _OpenAIReply):
    async for kind, p in gw.events(job):
        if kind == "started" and reply.chat:
            yield reply.chunk([reply.choice(first=True)])
        elif kind == "token":
            yield reply.chunk([reply.choice(p["t"])])
        elif kind == "end":
            yield reply.chunk([reply.choice(finish=OPENAI_FINISH[p.stop_reason])],
                              **({} if reply.include_usage else {"usage": reply.usage(p)}))
            if reply.include_usage:
                yield sse({"id": reply.id, "object": reply.chunk_object, "created": reply.created,
                           "model": gw.name, "choices": [], "usage": reply.usage(p)})
            yield "data: [DONE]\n\n"
        elif kind == "error":
            yield sse({"error": p})
