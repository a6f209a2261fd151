"""Time one numba decode step on the default model (or --model), fused (one numba call per step) and op by op.

    python tools/numba_decode_step.py [--model PATH] [--steps 60]

Prints the median wall time of `steps` one-token steps through backend.make_decoder after a 6-token prompt,
for LLORCH_NUMBA_FUSED=1 and =0, in one process (same machine state for both).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def step_ms(model, fused: bool, steps: int) -> float:
    import llorch_ref

    os.environ["LLORCH_NUMBA_FUSED"] = "1" if fused else "0"
    eng = llorch_ref.load(model, backend="numba")
    cache = eng.new_cache()
    ids = eng.tokenizer.encode("The capital of France is") if eng.tokenizer else list(range(1, 7))
    eng.forward(ids, cache, rows=[len(ids) - 1])
    dec = eng.backend.make_decoder(eng, cache)
    for _ in range(5):
        dec(5)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        dec(5)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    for fused in (True, False, True):
        print(f"{'fused' if fused else 'op by op'}: {step_ms(a.model, fused, a.steps):.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
