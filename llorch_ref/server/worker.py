"""One generation at a time per engine, in a worker thread; requests wait in a bounded queue.

Each job streams events back to the asyncio side through a thread-safe hand-off. A job whose client went
away is cancelled (its cancel Event is checked before every token). Nothing of one job (cache, RNG)
survives into the next: Engine.generate makes both per request.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..engine import GenerationResult
from ..errors import LlorchError


class QueueFull(Exception):
    pass


@dataclass
class Job:
    kwargs: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cancel: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult = field(default_factory=GenerationResult)

    def emit(self, kind, payload=None):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the requester's event loop is closed: nobody listens, stop the work
            self.cancel.set()


class Worker:
    def __init__(self, engine, max_queue: int = 16):
        self.engine = engine
        self.max_queue = max_queue
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.pending = 0                 # queued + running
        self.running: Job | None = None
        self.served = 0
        self.state = "idle"
        self._thread = threading.Thread(target=self._run, name="llorch-worker", daemon=True)
        self._thread.start()

    def submit(self, kwargs: dict, job_id: str | None = None) -> Job:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests queued or running (limit {self.max_queue})")
            self.pending += 1
        job = Job(kwargs=kwargs, loop=loop, events=asyncio.Queue())
        if job_id:
            job.job_id = job_id
        self._q.put(job)
        return job

    def cancel(self, job_id: str) -> bool:
        job = self.running
        if job is not None and job.job_id == job_id:
            job.cancel.set()
            return True
        for j in list(self._q.queue):
            if j.job_id == job_id:
                j.cancel.set()
                return True
        return False

    def _run(self):
        while True:
            job = self._q.get()
            self.running, self.state = job, "busy"
            try:
                if job.cancel.is_set():
                    job.result.stop_reason = "cancelled"
                    job.emit("end", job.result)
                    continue
                job.emit("started", {"started_at": time.time()})
                i = 0
                for piece in self.engine.generate(result=job.result, cancel=job.cancel, **job.kwargs):
                    job.emit("token", {"t": piece, "i": i})
                    i += 1
                job.emit("end", job.result)
            except LlorchError as e:
                job.emit("error", {"code": "INVALID_REQUEST", "message": str(e)})
            except Exception as e:  # a bug: report it on the stream, keep serving
                job.emit("error", {"code": "INFERENCE_FAILED", "message": f"{type(e).__name__}: {e}"})
            finally:
                self.served += 1
                self.running, self.state = None, "idle"
                with self._lock:
                    self.pending -= 1
