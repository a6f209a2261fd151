"""float16 GEMMs of a 7B prefill (512 tokens) on the GPU at hand: CuPy's matmul with its casts (float16 out, cast
back), cuda_half.half_gemm (gemmEx, float32 out: what the backend runs), the same after giving cuBLAS a 32 MiB
workspace, and torch.matmul; TFLOPS of each.

    OUT=DIR python tools/gpu_gemm_probe.py      # writes DIR/gemm_probe.json

CUDA events around 20 products, medians of 5. The workspace is set through cublasSetWorkspace_v2 on CuPy's own
cuBLAS handle (ctypes), which CuPy does not expose.
"""
import ctypes
import glob
import json
import os

import cupy as cp
import numpy as np

SHAPES = [(512, 4096, 12288), (512, 4096, 4096), (512, 4096, 22016), (512, 11008, 4096)]   # T, K, N


def timed(fn):
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        fn()
    ts = []
    for _ in range(5):
        ev0.record()
        for _ in range(20):
            fn()
        ev1.record()
        ev1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(ev0, ev1) / 20)
    return float(np.median(ts))


def cublas_lib():
    import cupy_backends
    for pat in ("libcublas.so.12*", "libcublas.so.13*", "libcublas.so*"):
        for d in [os.path.dirname(cupy_backends.__file__), "/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]:
            hits = glob.glob(os.path.join(d, "**", pat), recursive=True)
            if hits:
                return ctypes.CDLL(hits[0])
    return ctypes.CDLL("libcublas.so")


def main():
    res = {"card": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": []}
    data = {s: (cp.random.standard_normal((s[0], s[1]), dtype=cp.float32),
                cp.random.standard_normal((s[2], s[1]), dtype=cp.float32).astype(cp.float16)) for s in SHAPES}

    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from llorch_ref.backends.cuda_half import half_gemm

    def cupy_rows(label):
        for (t, k, n), (x, w) in data.items():
            ms = timed(lambda x=x, w=w: (x.astype(cp.float16) @ w.T).astype(cp.float32))
            ms_gemm = timed(lambda x=x, w=w: x.astype(cp.float16) @ w.T)
            ms_half = timed(lambda x=x, w=w: half_gemm(cp, x, w))
            res["rows"].append({"how": label, "shape": [t, k, n], "ms": round(ms, 4), "gemm_only_ms": round(ms_gemm, 4),
                                "tflops": round(2 * t * k * n / ms_gemm / 1e9, 1),
                                "half_gemm_ms (gemmEx, float32 out, with the input cast)": round(ms_half, 4)})
            print(json.dumps(res["rows"][-1]), flush=True)
    cupy_rows("cupy (matmul, float16 out, cast back)")
    try:
        import torch
        for (t, k, n), (x, w) in data.items():
            xt = torch.as_tensor(x, device="cuda").half()
            wt = torch.as_tensor(w, device="cuda")
            ms = timed(lambda xt=xt, wt=wt: torch.matmul(xt, wt.T))
            res["rows"].append({"how": f"torch {torch.__version__}", "shape": [t, k, n], "gemm_only_ms": round(ms, 4),
                                "tflops": round(2 * t * k * n / ms / 1e9, 1)})
            print(json.dumps(res["rows"][-1]), flush=True)
    except Exception as e:                               # noqa: BLE001
        res["torch_error"] = f"{type(e).__name__}: {e}"[:300]
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gemm_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
