"""Corpus statistics on Ray: the chunks of harness/corpus_eval.py as tasks on actors that build the two logit
sources once. A local Ray (no address) or an existing cluster (an address). An actor that dies (its process or
its node killed) has its chunk given to another actor, and a replacement actor is started: every chunk is
scored, and counted, exactly once. The scores are those of the in-process run (the same sources, the same
chunks).
"""
from __future__ import annotations

import os
import socket
import time

from ..errors import LlorchError, ParameterError
from .corpus_eval import EvalResult, build_sources, eval_chunk
from .kld import ChunkScores

MAX_ATTEMPTS = 4          # a chunk whose actor died this many times is an error, not an endless loop
PROBE_SECONDS = 5.0       # how long a cluster's address may take to accept a connection and answer HTTP/2


class RayEvalError(LlorchError):
    """A distributed evaluation could not complete."""


def ray_endpoint(address: str) -> tuple[str, int]:
    """--ray ADDRESS -> (host, port): host:port, [IPv6]:port, or ray://host:port (a Ray Client server)."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ParameterError(f"--ray {address}: not an address (host:port, or ray://host:port for a Ray Client "
                             "server; --ray alone starts a local Ray)")
    return host, int(port)


def check_cluster_address(address: str | None):
    """Refuses, within PROBE_SECONDS and before Ray is imported, an address where no gRPC server answers
    (ray.init would retry it for good): nothing accepts a TCP connection there, or what does is not an HTTP/2
    server (a Ray cluster's GCS and a Ray Client server both speak gRPC). None or "auto" (Ray finds the cluster
    itself) pass."""
    if address in (None, "", "auto"):
        return
    host, port = ray_endpoint(address)
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS) as s:
            s.sendall(HTTP2_PREFACE)
            answer = _read_some(s, 9)
    except OSError as e:
        why = f"no answer within {PROBE_SECONDS:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise RayEvalError(f"--ray {address}: no Ray cluster answers there ({why}); start one with "
                           "`ray start --head`, or give the address it prints") from None
    if len(answer) < 9 or answer[3] != 0x04:       # an HTTP/2 server's first frame is its SETTINGS (type 4)
        what = "an HTTP/1 server" if answer.startswith(b"HTTP/") else "a server that does not speak gRPC"
        raise RayEvalError(f"--ray {address}: no Ray cluster answers there ({what} does); give the address "
                           "`ray start --head` prints")


# the client's connection preface of HTTP/2 (RFC 9113, 3.4) and an empty SETTINGS frame
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _read_some(s, n: int) -> bytes:
    """Up to n bytes from socket s, fewer if it closes; its timeout bounds each wait."""
    data = b""
    while len(data) < n:
        piece = s.recv(n - len(data))
        if not piece:
            break
        data += piece
    return data


def on_gpu(*specs) -> bool:
    """Whether a side runs llorch-ref on cupy: its actors then take a GPU each (Ray sets CUDA_VISIBLE_DEVICES)."""
    return any(s.kind == "cupy" for s in specs)


def _scorer_class(ray):
    @ray.remote(num_cpus=1, max_restarts=0)
    class Scorer:
        def __init__(self, subject, reference, ctx):
            self.subject, self.reference = build_sources(subject, reference, ctx)

        def score(self, index, tokens):
            return eval_chunk(index, tokens, self.subject, self.reference).to_json()

        def where(self):
            return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}
    return Scorer


def run_eval_ray(subject_spec, reference_spec, chunks, text_name: str, address=None, progress=None,
                 n_actors: int | None = None) -> EvalResult:
    try:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError
    except ImportError as e:
        raise RayEvalError(f"--ray needs Ray: pip install 'llorch-ref[ray]' ({e})") from None
    started_here = not ray.is_initialized()
    if started_here:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise RayEvalError(f"--ray {address or '(local)'}: cannot start or join Ray ({e})") from None
    ctx = len(chunks[0])
    t0 = time.perf_counter()
    try:
        Scorer = _scorer_class(ray)
        res = ray.cluster_resources()
        gpus = int(res.get("GPU", 0)) if on_gpu(subject_spec, reference_spec) else 0
        if on_gpu(subject_spec, reference_spec) and gpus < 1:
            raise RayEvalError("a cupy side on Ray needs a GPU in the cluster, and Ray sees none")
        n = max(1, min(len(chunks), n_actors or gpus or int(res.get("CPU", 1))))
        n = min(n, gpus) if gpus else n                  # an actor a GPU: more would wait for one for good
        new_actor = lambda: Scorer.options(scheduling_strategy="SPREAD", **({"num_gpus": 1} if gpus else {})).remote(
            subject_spec, reference_spec, ctx)
        actors, nodes, started = [], set(), 0
        while len(actors) < n:                        # an actor that dies while starting is replaced too
            a = new_actor()
            started += 1
            try:
                nodes.add(ray.get(a.where.remote())["node"])
                actors.append(a)
            except (RayActorError, ActorDiedError):
                if started >= n + MAX_ATTEMPTS:
                    raise RayEvalError(f"{started} actors started, {len(actors)} alive: Ray cannot keep them") from None
        t_load = time.perf_counter() - t0
        results, attempts, rerun = {}, {}, 0
        queue = list(range(len(chunks)))
        running = {}                                      # object ref -> (actor, chunk index)

        def submit(actor):
            if queue:
                i = queue.pop(0)
                attempts[i] = attempts.get(i, 0) + 1
                running[actor.score.remote(i, chunks[i])] = (actor, i)
        for a in actors:
            submit(a)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            actor, i = running.pop(done[0])
            try:
                scores = ChunkScores.from_json(ray.get(done[0]))
            except (RayActorError, ActorDiedError):
                if attempts[i] >= MAX_ATTEMPTS:
                    raise RayEvalError(f"chunk {i}: its actor died {attempts[i]} times") from None
                queue.insert(0, i)                       # the chunk goes to the next actor; a replacement starts
                rerun += 1
                actor = new_actor()
                try:
                    nodes.add(ray.get(actor.where.remote())["node"])
                except (RayActorError, ActorDiedError):
                    if not running:                      # no actor left to take the queue
                        raise RayEvalError("the replacement actor died too and none is left") from None
                    continue
                submit(actor)
                continue
            if i not in results:                         # counted exactly once
                results[i] = scores
                if progress:
                    progress(ctx)
            submit(actor)
        missing = [i for i in range(len(chunks)) if i not in results]
        if missing:
            raise RayEvalError(f"chunks {missing[:5]} were never scored")
    finally:
        if started_here:
            ray.shutdown()
    dt = time.perf_counter() - t0 - t_load
    return EvalResult(subject_spec.label, reference_spec.label, text_name, ctx, [results[i] for i in range(len(chunks))],
                      {"load_s": t_load, "eval_s": dt, "tokens_per_s": len(chunks) * ctx / dt if dt > 0 else None,
                       "actors": n, "nodes": len(nodes), "chunks_rerun": rerun},
                      where=f"ray: {n} actors on {len(nodes)} node(s), {rerun} chunk(s) rerun after an actor died")
