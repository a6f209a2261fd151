"""numpy oracle's prompt at 2 threads: idle vs N spinning processes. python np_busy.py MODEL NBUSY"""
import sys, time, subprocess, statistics
import llorch_ref
e = llorch_ref.load(sys.argv[1], backend="numpy", threads=2)
ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:64]
e.forward(ids, e.new_cache(), rows=[63])
spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(sys.argv[2]))]
time.sleep(1.0)
ts = []
try:
    for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 7):
        t = time.perf_counter(); e.forward(ids, e.new_cache(), rows=[63]); ts.append(time.perf_counter() - t)
finally:
    for p in spin: p.kill()
print(f"busy {sys.argv[2]}: prefill 64 tok/s median {64/statistics.median(ts):.1f} runs " + " ".join(f"{64/t:.0f}" for t in ts))
