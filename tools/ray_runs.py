"""The same `llorch-ref eval` in-process, on a local Ray, and on a two-node Ray cluster on loopback (a head and
a worker node started with `ray start`, one CPU each), the last with one actor's process killed mid-run; the
statistics of every run compared with the in-process one, and the throughput of each.

    python tools/ray_runs.py [--chunks 8] --out results/eval/ray-runs.md -- EVAL ARGS (e.g. --subject llamacpp)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from llorch_ref.harness.bundle import cpu_model


def eval_run(args, js, ray=None, kill_after_s=None):
    cmd = [sys.executable, "-m", "llorch_ref.cli", "eval", *args, "--json", str(js), "--overwrite"]
    if ray is not None:
        cmd += ["--ray"] + ([ray] if ray else [])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = None
    if kill_after_s is not None:
        time.sleep(kill_after_s)
        for q in psutil.process_iter(["cmdline"]):
            if any("ray::Scorer" in c for c in (q.info["cmdline"] or [])):
                os.kill(q.pid, signal.SIGKILL)
                killed = q.pid
                break
    err = p.communicate()[1]
    if p.returncode:
        sys.exit(err[-3000:])
    return json.loads(Path(js).read_text()), time.perf_counter() - t0, killed


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--kill-after", type=float, default=40.0, help="seconds into the cluster run")
    ap.add_argument("--out", required=True)
    ap.add_argument("eval_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.eval_args if x != "--"] + ["--chunks", str(a.chunks)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    os.environ.update(env)
    rows = []
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rayruns") as tmp:
        base, t, _ = eval_run(args, Path(tmp) / "here.json")
        rows.append(("in-process", base, t, None))
        out, t, _ = eval_run(args, Path(tmp) / "local.json", ray="")
        rows.append(("local Ray (`--ray`)", out, t, None))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start = lambda *x: subprocess.run(["ray", "start", *x], env=env, capture_output=True, text=True, check=True)
        start("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", "--node-ip-address=127.0.0.1",
              f"--temp-dir={tmp}/r")
        try:
            start(f"--address=127.0.0.1:{port}", "--num-cpus=1", "--node-ip-address=127.0.0.1")
            out, t, _ = eval_run(args, Path(tmp) / "cluster.json", ray=f"127.0.0.1:{port}")
            rows.append(("two-node cluster (`--ray 127.0.0.1:PORT`)", out, t, None))
            out, t, killed = eval_run(args, Path(tmp) / "killed.json", ray=f"127.0.0.1:{port}",
                                      kill_after_s=a.kill_after)
            rows.append((f"two-node cluster, one actor's process (pid {killed}) killed at {a.kill_after:.0f} s", out, t,
                         killed))
        finally:
            subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True)
    lines = ["# `llorch-ref eval` in-process and on Ray", "",
             f"`python tools/ray_runs.py --chunks {a.chunks} --out {a.out} -- {' '.join(a.eval_args[1:] if a.eval_args[:1] == ['--'] else a.eval_args)}` "
             f"on {cpu_model()} (2 cores; the cluster's two nodes, one CPU each, share them).", "",
             "| run | where | chunks rerun | statistics equal to in-process | Mean KLD | tokens/s | wall (s) |",
             "|---|---|---|---|---|---|---|"]
    for name, out, t, _ in rows:
        same = out["statistics"] == base["statistics"] and out["kld_values"] == base["kld_values"]
        lines.append(f"| {name} | {out['where']} | {out['timings'].get('chunks_rerun', '-')} | "
                     f"{'yes, bit for bit' if same else 'NO'} | {out['statistics']['Mean KLD'][0]:.8g} | "
                     f"{out['timings']['tokens_per_s']:.0f} | {t:.0f} |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
