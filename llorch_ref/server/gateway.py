"""From an HTTP request to a job on the worker and back: validation against the engine (sampling values,
max_tokens, stop strings, log-probabilities asked (logprobs.bounds_error), the prompt's length, tokenized off the event loop), admission, the job's tie to its
connection (a client that leaves cancels its job), and the job's events as an async stream."""
from __future__ import annotations

import asyncio
import json

from fastapi import Request

from ..errors import LlorchError
from ..generate.sampling import SamplingParams
from . import logprobs
from .guard import error_response
from .schemas import ChatRequest
from .worker import JobIdInUse, QueueFull, Worker

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


class Gateway:
    def __init__(self, engine, max_queue: int, name: str, default_temperature_openai: float):
        self.engine, self.name = engine, name
        self.worker = Worker(engine, max_queue=max_queue)
        self.default_temperature_openai = default_temperature_openai
        self.watchers: set[asyncio.Task] = set()
        self._tokens_json = None

    def tokens_json(self) -> logprobs.TokenJSON:
        """The vocabulary's JSON pieces, made at the first request for log-probabilities."""
        if self._tokens_json is None:
            self._tokens_json = logprobs.TokenJSON(self.engine.tokenizer)
        return self._tokens_json

    def prepare(self, req, openai: bool):
        """Request -> (Engine.generate kwargs, {field: message}). Tokenizes: runs in a thread, off the loop."""
        data = req.model_dump(exclude_none=True)
        sampling = {k: data[k] for k in SAMPLING_FIELDS if k in data}
        if openai:
            sampling.setdefault("temperature", self.default_temperature_openai)
        fields = SamplingParams(**sampling).errors()
        n_ctx = self.engine.n_ctx
        max_tokens = data.get("max_tokens", 16 if openai else 128)
        if not 1 <= max_tokens <= n_ctx:
            fields["max_tokens"] = f"must be in 1..{n_ctx}, got {max_tokens}"
        stop = data.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > 4 or any(not s or len(s) > 100 for s in stop):
            fields["stop"] = "at most 4 non-empty strings of at most 100 characters"
        kw = dict(max_tokens=max_tokens, stop=stop, **sampling)
        k = req.top_logprobs_asked() if openai else None
        why = logprobs.bounds_error(k, max_tokens, self.engine.config.n_vocab, bool(getattr(req, "stream", False)))
        if why:
            fields["top_logprobs" if isinstance(req, ChatRequest) else "logprobs"] = why
        elif k is not None:
            kw["logprobs"] = k
        echo = bool(getattr(req, "echo", False))
        if echo and req.stream:
            fields["echo"] = "the prompt is echoed on non-streaming requests only (send stream: false)"
        if isinstance(req, ChatRequest):
            kw["messages"] = [m.plain() for m in req.messages]
        else:
            kw["prompt"] = req.prompt
        where = "prompt" if "prompt" in kw else "messages"
        if not fields:                  # tokenize only a request that is otherwise valid
            try:
                ids = self.engine.encode_prompt(kw.get("prompt"), messages=kw.get("messages"))
                if len(ids) + 1 > n_ctx:
                    fields[where] = f"{len(ids)} tokens leave no room in the context of {n_ctx}"
                elif k is not None:
                    why = logprobs.prompt_error(k, len(ids), max_tokens, self.engine.config.n_vocab, echo)
                    if why:
                        fields["echo" if echo else where] = why
            except LlorchError as e:    # the tokenizer or the chat template
                fields[where] = str(e)
        kw["echo"] = echo
        return kw, fields

    async def start(self, req, request: Request, openai: bool, job_id: str):
        """Admission, preparation off the event loop, then the queue; -> (job, None) or (None, response).
        The slot taken at admission is given back on every path that does not make a job, and the job is
        tied to its connection from the moment it is queued."""
        try:
            self.worker.admit()
        except QueueFull as e:
            return None, error_response(503, "QUEUE_FULL", f"server busy: {e}; retry later",
                                        headers={"Retry-After": "1"})
        job = None
        try:
            kw, fields = await asyncio.to_thread(self.prepare, req, openai)
            if fields:
                return None, error_response(400, "INVALID_REQUEST", "invalid request: " + "; ".join(
                    f"{k}: {v}" for k, v in fields.items()), fields)
            try:
                job = self.worker.submit(kw, job_id, admitted=True, logprobs=kw.pop("logprobs", None),
                                         echo=kw.pop("echo"))
            except JobIdInUse as e:
                return None, error_response(409, "JOB_ID_IN_USE", str(e), {"job_id": "already queued or running"})
        finally:
            if job is None:
                self.worker.release()
        watch = asyncio.create_task(self._cancel_on_disconnect(job, request.receive))
        self.watchers.add(watch)
        watch.add_done_callback(self.watchers.discard)
        job.watch = watch
        return job, None

    async def _cancel_on_disconnect(self, job, receive):
        """The job's tie to its connection: when the client goes away, the job is cancelled (a queued job
        leaves the queue at once). Ended when the job's response is done."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                job.client_left = True
                self.worker.cancel_job(job)
                return

    async def events(self, job):
        """Yields (kind, payload) until the job ends; if the consumer stops early (the response stream was
        closed: the client went away), the job is cancelled."""
        done = False
        try:
            while not done:
                kind, payload = await job.events.get()
                done = kind in ("end", "error")
                yield kind, payload
        finally:
            job.watch.cancel()
            if not done:
                self.worker.cancel_job(job)
