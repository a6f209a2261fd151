"""One generation at a time per engine, in a worker thread; requests wait in a bounded queue.

The job lifecycle, in one place:
- admit(): a slot is reserved before any work on the request (tokenization included), so --max-queue bounds
  everything a client can make the server do; a slot not turned into a job is given back with release().
- submit(): the job enters the queue under its id (ids are unique among queued and running jobs).
- cancel(): a queued job leaves the queue at once (its slot freed, "end" with stop_reason "cancelled"
  emitted); a running one stops before its next token or between the layers of its prefill.
Each job streams events back to the asyncio side through a thread-safe hand-off. Nothing of one job
(cache, RNG) survives into the next: Engine.generate makes both per request.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..engine import GenerationResult
from ..errors import LlorchError
from .logprobs import teacher_forced


class QueueFull(Exception):
    pass


class JobIdInUse(Exception):
    pass


@dataclass
class Job:
    kwargs: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancel: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult = field(default_factory=GenerationResult)
    watch: object = None            # the server's task that cancels the job when its client goes away
    client_left: bool = False       # set by that task: tokens made after it are work for nobody
    logprobs: int | None = None     # top log-probabilities a step asked for (None: none)
    logp: object = None             # then: [tokens, V] float64, the teacher-forced distributions (logprobs.py)
    echo: bool = False              # the prompt's tokens are answered too (with logprobs: their distributions)

    def emit(self, kind, payload=None):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the requester's event loop is closed: nobody listens, stop the work
            self.cancel.set()


class Worker:
    def __init__(self, engine, max_queue: int = 16):
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self._queue: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}              # queued and running, by id
        self._cond = threading.Condition()
        self.pending = 0                             # slots taken: admitted (tokenizing), queued, running
        self.running: Job | None = None
        self.served = 0
        self.cancelled = 0                           # jobs cancelled (queued or running) since start
        self.tokens_out = 0                          # tokens generated since start, over every job
        self.tokens_after_client_left = 0            # of those, made after the job's client had gone
        self.state = "idle"
        self._thread = threading.Thread(target=self._run, name="llorch-worker", daemon=True)
        self._thread.start()

    # -- the asyncio side ------------------------------------------------------------------------------
    def admit(self):
        """Reserve a slot, or QueueFull. Pair with submit() or release()."""
        with self._cond:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests being prepared, queued or running (limit {self.max_queue})")
            self.pending += 1

    def release(self):
        """Give back a slot from admit() that did not become a job (the request was refused)."""
        with self._cond:
            self.pending -= 1

    def submit(self, kwargs: dict, job_id: str | None = None, admitted: bool = False,
               logprobs: int | None = None, echo: bool = False) -> Job:
        """Queue a job (in a slot from admit() when admitted, else one taken now: QueueFull); JobIdInUse if a
        queued or running job has that id (an admitted slot is then still held: release() it). logprobs: the
        job's tokens get their teacher-forced distributions once generated (job.logp)."""
        if not admitted:
            self.admit()
        job = Job(kwargs=kwargs, loop=asyncio.get_running_loop(), events=asyncio.Queue(), logprobs=logprobs,
                  echo=echo)
        if job_id:
            job.job_id = job_id
        with self._cond:
            if job.job_id in self._jobs:
                if not admitted:
                    self.pending -= 1
                raise JobIdInUse(f"job_id {job.job_id!r} is already queued or running")
            self._jobs[job.job_id] = job
            self._queue.append(job)
            self._cond.notify()
        return job

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job by id -> whether there was one."""
        with self._cond:
            job = self._jobs.get(job_id)
        return job is not None and self.cancel_job(job)

    def cancel_job(self, job: Job) -> bool:
        """Cancel this job if it is still queued or running -> whether it was."""
        with self._cond:
            if self._jobs.get(job.job_id) is not job:
                return False
            job.cancel.set()
            if job is not self.running:
                self._queue.remove(job)
                del self._jobs[job.job_id]
                self.pending -= 1
                self.cancelled += 1
                job.result.stop_reason = "cancelled"
                job.emit("end", job.result)
        return True

    # -- the worker thread -----------------------------------------------------------------------------
    def _run(self):
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
                self.running, self.state = job, "busy"
            try:
                job.emit("started", {"started_at": time.time()})
                i = 0
                for piece in self.engine.generate(result=job.result, cancel=job.cancel, **job.kwargs):
                    job.emit("token", {"t": piece, "i": i})
                    i += 1
                    self.tokens_after_client_left += job.client_left
                res = job.result
                if job.logprobs is not None and (res.token_ids or job.echo) and not job.cancel.is_set():
                    job.logp = teacher_forced(self.engine, res.prompt_ids, res.token_ids, echo=job.echo)
                job.emit("end", job.result)
            except LlorchError as e:
                job.emit("error", {"code": "INVALID_REQUEST", "message": str(e)})
            except Exception as e:  # a bug: report it on the stream, keep serving
                job.emit("error", {"code": "INFERENCE_FAILED", "message": f"{type(e).__name__}: {e}"})
            finally:
                with self._cond:
                    self.served += 1
                    self.tokens_out += len(job.result.token_ids)
                    self.cancelled += job.cancel.is_set()
                    self._jobs.pop(job.job_id, None)
                    self.running, self.state = None, "idle"
                    self.pending -= 1
