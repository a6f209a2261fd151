"""The worker thread outlives its clients: a request whose event loop is gone must not stop the next one."""
from __future__ import annotations

import asyncio
import time

from llorch_ref.server.worker import Worker


async def _collect(job):
    events = []
    while True:
        kind, payload = await asyncio.wait_for(job.events.get(), timeout=120)
        events.append(kind)
        if kind in ("end", "error"):
            return events, payload


def test_worker_survives_a_client_whose_event_loop_closed(tiny_engine):
    w = Worker(tiny_engine)
    loop = asyncio.new_event_loop()

    async def submit():
        return w.submit({"prompt": "Once upon", "max_tokens": 40, "ignore_eos": True})

    orphan = loop.run_until_complete(submit())
    loop.close()                                    # the client vanished with its loop
    deadline = time.monotonic() + 120
    while w.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.pending == 0 and w._thread.is_alive()
    assert orphan.cancel.is_set()                   # the work for nobody was stopped

    async def second():
        return await _collect(w.submit({"prompt": "Once upon", "max_tokens": 5, "ignore_eos": True}))

    events, result = asyncio.run(second())
    assert events[0] == "started" and events[-1] == "end"
    assert result.stop_reason == "max_tokens" and len(result.token_ids) == 5
