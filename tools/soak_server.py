"""Soak `llorch-ref serve` with clients that time out, retry and disconnect, while 1 MB prompts arrive.

    python tools/soak_server.py [--seconds 60] [--model PATH] [--out results/server/soak-hostile]

The server runs as its own process (`llorch-ref serve`, the default model, numpy backend) on loopback.
Clients, each in a thread, for --seconds:
- 3 official OpenAI clients (timeout drawn from 0.3-3 s, max_retries=2), non-streaming completions;
- 2 streaming clients on /execute that read a random number of tokens (0-20) and hang up;
- 1 client posting a ~1 MB prompt (over the context: refused after tokenization) every second, alternating
  /v1/completions and /v1/chat/completions;
- a prober, in a process of its own: GET /health every 50 ms, timing each answer.
Then the clients stop and the queue must drain. Reported: outcomes, /health latency (median, p99, max, how
many answers took over 100 ms), the time the server took to drain, and "tokens for nobody": tokens the
server generated minus tokens the clients received (a request abandoned mid-token costs at most the token
in flight, and a stream closed with unread tokens in its socket costs those), and of those, the tokens the
server made after it had seen the client leave (at most the one in flight per abandoned request).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llorch_ref.harness.bundle import cpu_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.received = 0

    def add(self, what, tokens=0):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1
            self.received += tokens


def openai_client(url, stop, tally, seed):
    import openai

    rng = random.Random(seed)
    while not stop.is_set():
        timeout = rng.uniform(0.3, 3.0)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=timeout, max_retries=2)
        try:
            r = c.completions.create(model="x", prompt="Once upon a time", max_tokens=rng.randint(8, 64),
                                     temperature=0)
            tally.add("openai: completed", r.usage.completion_tokens)
        except openai.APITimeoutError:
            tally.add("openai: timed out after 3 attempts")
        except openai.APIStatusError as e:
            tally.add(f"openai: HTTP {e.status_code}")


def streaming_client(url, stop, tally, seed):
    rng = random.Random(seed)
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            want = rng.randint(0, 20)
            got = 0
            try:
                with c.stream("POST", url + "/execute", json={"prompt": "Once upon a time", "max_tokens": 64}) as r:
                    if r.status_code != 200:
                        tally.add(f"stream: HTTP {r.status_code}")
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        ev = json.loads(line[6:])
                        if ev["type"] == "token":
                            got += 1
                            if got >= want:
                                break            # hang up mid-stream
                        elif ev["type"] == "end":
                            tally.add("stream: read to the end", ev["tokens_out"])
                            got = None
                            break
                if got is not None:
                    tally.add("stream: hung up", got)
            except httpx.HTTPError as e:
                tally.add(f"stream: {type(e).__name__}")


def big_prompts(url, stop, tally):
    text = ("The quick brown fox jumps over the lazy dog. " * 25000)[: (1 << 20) - 300]
    with httpx.Client(timeout=60) as c:
        i = 0
        while not stop.is_set():
            if i % 2 == 0:
                r = c.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 4})
            else:
                r = c.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                              "max_tokens": 4})
            tally.add(f"1 MB prompt: HTTP {r.status_code}")
            i += 1
            stop.wait(1.0)


def prober(url, stop, out):
    """In its own process, so that the clients' threads in this one do not delay the timing."""
    lat = []
    with httpx.Client(timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url + "/health").raise_for_status()
            lat.append(time.perf_counter() - t0)
            stop.wait(0.05)
    out.put(lat)


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="results/server/soak-hostile")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = ["llorch-ref", "serve", "--port", str(port), "--max-queue", "8"] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                start = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"server did not start: {server.stderr.read()}") from None
                time.sleep(0.2)
        stop, tally = threading.Event(), Tally()
        threads = ([threading.Thread(target=openai_client, args=(url, stop, tally, i)) for i in range(3)]
                   + [threading.Thread(target=streaming_client, args=(url, stop, tally, 10 + i)) for i in range(2)]
                   + [threading.Thread(target=big_prompts, args=(url, stop, tally))])
        probe_stop, probe_out = multiprocessing.Event(), multiprocessing.Queue()
        probe = multiprocessing.Process(target=prober, args=(url, probe_stop, probe_out))
        probe.start()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        t_clients_gone = time.perf_counter()
        while True:
            h = httpx.get(url + "/health", timeout=10).json()
            if h["queued"] == 0 and h["state"] == "idle":
                break
            time.sleep(0.01)
        drain_s = time.perf_counter() - t_clients_gone
        probe_stop.set()
        lat = probe_out.get(timeout=60)
        probe.join()
        end = httpx.get(url + "/health", timeout=10).json()
    finally:
        server.terminate()
        server.wait(30)
    made = end["tokens_out"] - start["tokens_out"]
    abandoned = sum(n for k, n in tally.counts.items() if "timed out" in k or "hung up" in k)
    report = {
        "command": " ".join(["python", "tools/soak_server.py"] + sys.argv[1:]), "cpu": cpu_model(),
        "cores": os.cpu_count(), "seconds": args.seconds, "model": start["model"], "outcomes": tally.counts,
        "health": {"answers": len(lat), "median_ms": 1000 * percentile(lat, 0.5), "p99_ms": 1000 * percentile(lat, 0.99),
                   "max_ms": 1000 * max(lat), "over_100ms": sum(x > 0.1 for x in lat)},
        "drain_s_after_clients_stopped": drain_s, "jobs_served": end["served"] - start["served"],
        "jobs_cancelled": end["cancelled"] - start["cancelled"], "tokens_generated": made,
        "tokens_received_by_clients": tally.received, "tokens_for_nobody": made - tally.received,
        "abandoned_requests": abandoned,
        "tokens_after_client_left": end["tokens_after_client_left"] - start["tokens_after_client_left"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    h = report["health"]
    md = ["# Server soak: clients that time out, retry and hang up, with 1 MB prompts", "",
          f"`{report['command']}` on {report['cpu']} ({report['cores']} cores), model {report['model']}, "
          f"{args.seconds:.0f} s of clients.", "",
          "| outcome | requests |", "|---|---|"] + [f"| {k} | {v} |" for k, v in sorted(tally.counts.items())] + [
          "", "| figure | value |", "|---|---|",
          f"| /health answers | {h['answers']} |",
          f"| /health latency median / p99 / max | {h['median_ms']:.1f} / {h['p99_ms']:.1f} / {h['max_ms']:.1f} ms |",
          f"| /health answers over 100 ms | {h['over_100ms']} |",
          f"| jobs served / cancelled | {report['jobs_served']} / {report['jobs_cancelled']} |",
          f"| abandoned requests (client timeouts after retries, hang-ups) | {abandoned} |",
          f"| tokens generated / received by clients / for nobody | {made} / {tally.received} / {made - tally.received} |",
          f"| tokens the server made after it saw a client leave (the token in flight) | "
          f"{report['tokens_after_client_left']} |",
          f"| drain after the clients stopped | {drain_s * 1000:.0f} ms |", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
