"""Make F32 / F16 / Q8_0 / Q4_K_M copies of a GGUF model for band calibration and tests.

F32 and F16 come from `llorch-ref convert`; Q8_0 and Q4_K_M from llama.cpp's own quantizer
(llama_model_quantize through llama-cpp-python), applied to the F32 copy.

    python tools/make_quant_copies.py [--model PATH] [--out DIR] [--types f32,f16,q8_0,q4_k_m]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path


def quantize_with_llamacpp(src: Path, dst: Path, ftype_name: str):
    import llama_cpp

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
             "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[ftype_name]
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 2
    part = dst.with_name(dst.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(p))
    if rc != 0:
        raise SystemExit(f"error: llama_model_quantize({src} -> {ftype_name}) returned {rc}")
    part.rename(dst)


def make_copies(model: Path, out: Path, types) -> dict:
    from llorch_ref.convert import convert_gguf

    out.mkdir(parents=True, exist_ok=True)
    stem = model.name.removesuffix(".gguf").split(".")[0]
    paths = {}
    f32 = out / f"{stem}.F32.gguf"
    if not f32.exists():
        convert_gguf(model, f32, dtype="f32")
    paths["f32"] = f32
    for t in types:
        if t == "f32":
            continue
        dst = out / f"{stem}.{t.upper()}.gguf"
        if not dst.exists():
            if t == "f16":
                convert_gguf(model, dst, dtype="f16")
            else:
                quantize_with_llamacpp(f32, dst, t)
        paths[t] = dst
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", default="f32,f16,q8_0,q4_k_m")
    a = ap.parse_args()
    from llorch_ref.loaders.default_model import default_model_path, home

    model = Path(a.model) if a.model else default_model_path()
    out = Path(a.out) if a.out else home() / "models"
    for t, p in make_copies(model, out, a.types.split(",")).items():
        print(f"{t}\t{p}")


if __name__ == "__main__":
    sys.exit(main())
