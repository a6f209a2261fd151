"""Does starting the numba backend in a thread while the header and tokenizer are read shorten a load? (no: the GIL)
python overlap_thread.py MODEL serial|thread"""
import sys, time, threading
T = time.perf_counter
import llorch_ref
from llorch_ref.backends import get_backend
mode = sys.argv[2]
t0 = T()
if mode == "thread":
    box = {}
    def work():
        t = T(); box["b"] = get_backend("numba", threads=2); box["t"] = T() - t
    th = threading.Thread(target=work, daemon=True); th.start()
    m = llorch_ref.loaders.gguf_file.load_gguf(sys.argv[1], lazy=True)
    tok = llorch_ref.from_gguf_metadata(m.metadata, source=str(m.path))
    t_main = T() - t0
    th.join(); t_join = T() - t0
    print(f"thread: main {t_main:.3f} backend(in thread) {box['t']:.3f} all {t_join:.3f}")
else:
    m = llorch_ref.loaders.gguf_file.load_gguf(sys.argv[1], lazy=True)
    tok = llorch_ref.from_gguf_metadata(m.metadata, source=str(m.path))
    t_main = T() - t0
    t = T(); b = get_backend("numba", threads=2); tb = T() - t
    print(f"serial: main {t_main:.3f} backend {tb:.3f} all {T() - t0:.3f}")
