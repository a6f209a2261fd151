"""Sources of logits over a chunk of tokens, for corpus statistics: llorch-ref on any backend and numerics,
llama.cpp with any settings, transformers, or logits an engine under test wrote as llorch-dumps. A source is
described by a picklable `SourceSpec` and built where it runs (in-process, or once per Ray actor).

    src = SourceSpec("llamacpp", "model.gguf", {"kv_dtype": "float16", "flash_attn": True}).build(ctx=512)
    src.logits(tokens, first) -> [len(tokens) - 1 - first, V] float32: the rows that predict tokens[first + 1:]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..dump import load_dump
from ..errors import DumpError, ParameterError
from .engines import _import_hf, _load_hf_model, hf_folder_for
from .llamacpp import LlamaCpp
from .onnx_runtime import _import_ort, onnx_folder_for

ENGINE_KINDS = ("numpy", "numba", "cupy")


@dataclass(frozen=True)
class SourceSpec:
    kind: str                      # numpy | numba | cupy | llamacpp | transformers | onnxruntime | dump
    model: str                     # GGUF file or Hugging Face folder (dump: the dump file or folder of them)
    settings: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ", ".join(f"{k} {v}" for k, v in sorted(self.settings.items()) if v not in (None, False))
        return f"{self.kind} on {Path(self.model).name}" + (f" ({extra})" if extra else "")

    def build(self, ctx: int):
        if self.kind in ENGINE_KINDS:
            return EngineSource(self, ctx)
        if self.kind == "llamacpp":
            return LlamaCppSource(self, ctx)
        if self.kind == "transformers":
            return TransformersSource(self)
        if self.kind == "onnxruntime":
            return OnnxRuntimeSource(self)
        if self.kind == "dump":
            return DumpSource(self)
        raise ParameterError(f"unknown logits source {self.kind!r}")


class EngineSource:
    def __init__(self, spec: SourceSpec, ctx: int):
        import llorch_ref
        s = spec.settings
        self.spec = spec
        self.engine = llorch_ref.load(spec.model, backend=spec.kind, n_ctx=ctx, numerics=s.get("numerics", "exact"),
                                      kv_dtype=s.get("kv_dtype", "float32"))

    def logits(self, tokens, first: int) -> np.ndarray:
        return self.engine.backend.to_numpy(self.device_logits(tokens, first))

    def device_logits(self, tokens, first: int):
        """logits() as the backend holds them (a CuPy array on the cupy backend: scored on the device)."""
        e = self.engine
        out = e.forward(list(tokens), e.new_cache(), rows=list(range(first, len(tokens) - 1)))
        return out.astype(np.float32, copy=False)


class LlamaCppSource:
    def __init__(self, spec: SourceSpec, ctx: int):
        s = spec.settings
        self.spec = spec
        self.ctx = LlamaCpp(spec.model, n_ctx=ctx, n_batch=ctx, n_ubatch=int(s.get("n_ubatch") or 512),
                            kv_dtype=s.get("kv_dtype", "float32"), flash_attn=bool(s.get("flash_attn")),
                            n_threads=int(s.get("threads") or 2), n_gpu_layers=int(s.get("n_gpu_layers") or 0))

    def logits(self, tokens, first: int) -> np.ndarray:
        return self.ctx.eval(list(tokens))[first:len(tokens) - 1]


class TransformersSource:
    def __init__(self, spec: SourceSpec):
        self.spec = spec
        self.torch, transformers = _import_hf()
        self.model = _load_hf_model(self.torch, transformers, hf_folder_for(spec.model))

    def logits(self, tokens, first: int) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(tokens)])).logits[0, first:len(tokens) - 1]
        return out.float().numpy()


class OnnxRuntimeSource:
    """ONNX Runtime GenAI's own logits of every row of a chunk (an ONNX folder, or a GGUF file / Hugging Face
    folder built into one at settings["precision"])."""

    def __init__(self, spec: SourceSpec):
        _, self.og = _import_ort()
        self.spec = spec
        self.model = self.og.Model(str(onnx_folder_for(spec.model, spec.settings.get("precision") or "fp32")))

    def logits(self, tokens, first: int) -> np.ndarray:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(tokens) + 1, do_sample=False)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(list(tokens), dtype=np.int32))
        return np.array(gen.get_output("logits"), dtype=np.float32)[0, first:len(tokens) - 1]


class DumpSource:
    """Logits an engine under test wrote: llorch-dump files (one per chunk, token_ids = the chunk, cp8.logits
    holding at least the scored rows), a file or a folder of them; each chunk is looked up by its tokens."""

    def __init__(self, spec: SourceSpec):
        p = Path(spec.model)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise ParameterError(f"--subject {p}: no .safetensors dump files there")
        self.spec, self.by_tokens = spec, {}
        for f in files:
            d = load_dump(f)
            if not d.has("8", "logits"):
                raise DumpError(f"{f}: holds no cp8.logits")
            self.by_tokens[tuple(d.token_ids)] = (d, f)

    def logits(self, tokens, first: int) -> np.ndarray:
        hit = self.by_tokens.get(tuple(tokens))
        if hit is None:
            raise DumpError(f"no dump in {self.spec.model} ran this chunk's {len(tokens)} tokens (first ids "
                            f"{list(tokens)[:4]}); write one per chunk (llorch-ref eval --write-chunks DIR lists them)")
        d, f = hit
        want = list(range(first, len(tokens) - 1))
        rows = d.rows
        missing = sorted(set(want) - set(rows))
        if missing:
            raise DumpError(f"{f}: its logits miss row {missing[0]} (scored rows are {first}..{len(tokens) - 2})")
        a = d.raw("8", "logits").reshape(len(rows), -1)
        return a[[rows.index(r) for r in want]].astype(np.float32)
