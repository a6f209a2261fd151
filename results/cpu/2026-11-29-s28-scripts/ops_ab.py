"""A 128-token forward of the default model: session 28's RoPE/RMSNorm rows and query-head attention split against
NumPy's for several rows and KV-group split, in one process, alternating."""
import sys, time, statistics, types
import numpy as np
import llorch_ref
from llorch_ref.model import layers
from llorch_ref.backends.cpu_split import SPLIT
e = llorch_ref.load(sys.argv[1] if len(sys.argv) > 1 else None, backend="numba", threads=2)
new = types.SimpleNamespace(**vars(e.ops))
def old_attention_out(xp, q, k, v, mask, scale, kv_head):
    if q.shape[0] == 1:
        return new.attention_out(xp, q, k, v, mask, scale, kv_head)
    t, h, hd = q.shape; kv = k.shape[1]
    parts = min(SPLIT.threads, kv) if SPLIT.split and t * k.shape[0] >= 4096 else 1
    if parts == 1:
        return layers.attention(xp, q, k, v, mask, scale, kv_head)[0]
    g = h // kv; bounds = [kv * i // parts for i in range(parts + 1)]; out = np.empty((t, h, hd), np.float32)
    def one(i):
        k0, k1 = bounds[i], bounds[i + 1]
        part = layers.attention(xp, q[:, k0*g:k1*g], k[:, k0:k1], v[:, k0:k1], mask, scale, kv_head[k0*g:k1*g] - k0)[0]
        out[:, k0*g:k1*g] = part.reshape(t, (k1 - k0) * g, hd)
    SPLIT.run(one, parts)
    return out.reshape(t, h * hd)
old = dict(rope=lambda xp, x, c, s, st: layers.rope(xp, x, c, s, st) if x.shape[0] != 1 else new.rope(xp, x, c, s, st),
           rms_norm=lambda xp, x, w, eps: layers.rms_norm(xp, x, w, eps) if x.shape[0] != 1 else new.rms_norm(xp, x, w, eps),
           attention_out=old_attention_out)
ids = e.tokenizer.encode("The history of the world is long and full of surprises. " * 12)[:128]
def run(which):
    for n in old: setattr(e.ops, n, old[n] if which == "old" else getattr(new, n))
    t = time.perf_counter(); e.forward(ids, e.new_cache(), rows=[127]); return time.perf_counter() - t
outs = {}
for w in ("new", "old"):
    run(w); run(w)
a, b = [], []
for r in range(21):
    for w, acc in (("new", a), ("old", b)) if r % 2 == 0 else (("old", b), ("new", a)):
        acc.append(run(w))
ra = [y / x for x, y in zip(a, b)]
print(f"new {128/statistics.median(a):.1f} tok/s, old {128/statistics.median(b):.1f} tok/s; new/old {statistics.median(ra):.3f} (rounds {min(ra):.2f}-{max(ra):.2f})")
for w in ("new", "old"):
    for n in old: setattr(e.ops, n, old[n] if w == "old" else getattr(new, n))
    outs[w] = e.forward(ids, e.new_cache())
print("logits equal to the bit" if np.array_equal(outs["new"], outs["old"]) else f"logits differ: max abs {np.abs(outs['new'] - outs['old']).max():.3g}")
