"""Compile the cupy backend's CUDA sources to PTX with NVRTC on a machine without a GPU: the syntax and type
errors a device call would otherwise find (each costs device time). Needs NVRTC and the CUDA headers from PyPI,
in any environment (they are not project dependencies):

    python -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
    python tools/cuda_compile_check.py --nvrtc /tmp/nvrtc [--arch compute_90]

Prints one line per module (kernels found, PTX size) and the compiler's log on failure; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sources():
    from llorch_ref.backends import cuda_blocks, cuda_fused, cuda_ops
    return {"cuda_ops": cuda_ops._KERNELS_SRC, "cuda_blocks": cuda_blocks.SRC, "cuda_fused": cuda_fused.source()}


def compile_ptx(lib, include, name, src, arch):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None) == 0
    opts = [b"-std=c++17", b"-default-device", f"--gpu-architecture={arch}".encode(), f"-I{include}".encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    size = 0
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        size = n.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", required=True, help="the environment holding nvidia-cuda-nvrtc-cu12 and -runtime-cu12")
    ap.add_argument("--arch", default="compute_90")
    a = ap.parse_args()
    libs = glob.glob(f"{a.nvrtc}/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so*")
    incs = glob.glob(f"{a.nvrtc}/lib/python3*/site-packages/nvidia/cuda_runtime/include")
    if not libs or not incs:
        raise SystemExit(f"no NVRTC or CUDA headers under {a.nvrtc}: see this tool's docstring")
    lib = ctypes.CDLL(libs[0])
    failed = 0
    for name, src in sources().items():
        rc, log, size = compile_ptx(lib, incs[0], name, src, a.arch)
        kernels = src.count("__global__")
        print(f"{name}: {'ok' if rc == 0 else 'FAILED'} ({kernels} kernels, PTX {size} bytes)")
        if rc or "warning" in log:
            print(log)
        failed += rc != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
