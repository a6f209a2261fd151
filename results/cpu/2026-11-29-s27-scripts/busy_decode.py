"""numba decode with N spinning processes: the spare-thread rule (new) against 2 threads throughout (old), alternating.
python busy_decode.py MODEL NBUSY ROUNDS"""
import sys, time, subprocess, statistics, collections
import numba, llorch_ref
from llorch_ref.backends.cpu_split import SPLIT
e = llorch_ref.load(sys.argv[1], backend="numba", threads=2)
ids = e.tokenizer.encode("The history of the world is long and full of surprises.")
list(e.generate_ids(ids, max_tokens=8, ignore_eos=True))
orig = SPLIT.spare_threads
seen = collections.Counter()
def watch(t):
    n = orig(t); seen[n] += 1; return n
spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(sys.argv[2]))]
time.sleep(1.0)
res = {"new": [], "old": []}
try:
    for r in range(int(sys.argv[3])):
        for mode in (("new", "old") if r % 2 == 0 else ("old", "new")):
            SPLIT.spare_threads = watch if mode == "new" else (lambda t: t)
            t = time.perf_counter(); list(e.generate_ids(ids, max_tokens=64, ignore_eos=True)); res[mode].append(64 / (time.perf_counter() - t))
finally:
    for p in spin: p.kill()
print(f"busy {sys.argv[2]}: new median {statistics.median(res['new']):.1f} tok/s ({min(res['new']):.0f}-{max(res['new']):.0f}), "
      f"old {statistics.median(res['old']):.1f} ({min(res['old']):.0f}-{max(res['old']):.0f}); threads chosen {dict(seen)}, others at the end {SPLIT.others:.2f}")
