"""The checkpoint catalogue: specs (cp*.json), the dump schema, backend and local bands, as package data in
this folder (data, not code; see README.md here). Below everything that uses it: the dump format, the
references that write dumps and the harness that judges them all read it; it imports none of them."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import HarnessError

# Where the specs live: this package's folder (or LLORCH_CHECKPOINTS, for a catalogue of one's own).
SPEC_DIR = Path(__file__).resolve().parent

# Band class of a GGUF weight type: which band in each spec applies.
BAND_CLASS = {"F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0",
              "Q4_0": "Q4_x", "Q4_1": "Q4_x", "Q5_0": "Q4_x", "Q5_1": "Q4_x",
              "Q2_K": "K", "Q3_K": "K", "Q4_K": "K", "Q5_K": "K", "Q6_K": "K",
              "MatMulNBits4": "Q4_x", "MatMulNBits8": "Q8_0"}        # ONNX Runtime's block quantization
CLASS_ORDER = ["F32", "F16", "BF16", "Q8_0", "K", "Q4_x"]       # coarser to the right
# numerics="ggml" uses the band class "ggml" whatever the weight type: llama.cpp's arithmetic reproduced,
# so the expected difference is zero.
# llama.cpp with layers on its GPU backend sums in kernels of its own (CUDA: activations quantized for the
# integer products, cuBLAS for float weights): the weight class's bands measured on that backend, class "<class>+cuda"
# (tools/calibrate_bands.py --gpu-layers 99).
GPU = "+cuda"
GPU_CLASSES = ["F32", "F16", "Q8_0", "K", "Q4_x"]
BAND_CLASSES = CLASS_ORDER + [c + GPU for c in GPU_CLASSES] + ["ggml"]      # what --band-class takes


@dataclass
class TensorSpec:
    ours: str                 # name our forward records (llorch_ref.model.forward)
    llamacpp: dict            # {"name": "Qcur-{L}", "op": "ROPE", "occurrence": 0}
    layout: str               # how to bring llama.cpp's tensor to our shape (references/engines.py)
    order: int                # position in the forward pass within its scope (for first divergence)
    llamacpp_with_bias: dict | None = None   # the node after the bias add, for models with Q/K/V biases
    # arch -> the node its llama.cpp graph has instead (Phi-3: views of the fused qkv; "divide_by_scale": the
    # graph scales Q before Q.K^T), or null where that graph leaves the node unnamed (not covered)
    llamacpp_by_arch: dict | None = None
    when: str | None = None   # a Config switch (e.g. "qk_norm"): the tensor exists only in models that set it

    def applies(self, cfg) -> bool:
        """Whether this model's forward has the tensor (False: not applicable, which is not 'not covered')."""
        return self.when is None or cfg is None or bool(getattr(cfg, self.when))

    def node(self, cfg) -> dict | None:
        """The llama.cpp node to compare for this model, or None where its graph has no such named node."""
        if self.llamacpp_by_arch and cfg.arch in self.llamacpp_by_arch:
            return self.llamacpp_by_arch[cfg.arch]
        return self.llamacpp_with_bias if (self.llamacpp_with_bias and cfg.qkv_bias) else self.llamacpp

    def from_llamacpp(self, cfg, a):
        """llama.cpp's tensor in this checkpoint's convention (Phi-3's kq: undo the Q pre-scaling)."""
        if (self.node(cfg) or {}).get("divide_by_scale"):
            return (a / np.float32(cfg.scale)).astype(np.float32)
        return a


# The yes/no facts a spec states about its checkpoint (absent: false); the harness reads them, never the id.
FACTS = ("after_last_layer", "token_checkpoint", "chosen_tokens", "decode_step")


@dataclass
class Spec:
    id: str
    name: str
    title: str
    checks: str
    scope: str                # "layer" | "model" | "tokens"
    tensors: list
    bands: dict               # band class -> {"nmse": ..., ...}
    measured: dict
    path: Path
    dump: list = None         # dump-format tensors: [{"name", "shape", "dtype", "head_major"?, "rope_pairs"?, "derive"?}]
    order: float = 0          # place in the forward: 0 tokens, 1..7 inside a layer, 8..12 after the last layer
    after_last_layer: bool = False    # a float result of the head (8, 9, 11): a coarser class of a layer node holds on
    token_checkpoint: bool = False    # compared once under a derived tensor name (0, 10, 11, 12): covered by its id
    chosen_tokens: bool = False       # the tokens the model chooses (10 argmax, 12 greedy text): exact agreement
    decode_step: bool = False         # a model checkpoint compared at every decode step too (layer ones always are)

    def every_step(self) -> bool:
        """Whether a decode step compares this checkpoint: every layer checkpoint, and the model ones that say so."""
        return self.scope == "layer" or self.decode_step

    def tensors_for(self, cfg) -> list:
        """The tensors this checkpoint compares for a model (those whose `when` switch the model sets)."""
        return [t for t in self.tensors if t.applies(cfg)]

    def band(self, band_class: str) -> dict:
        if band_class not in self.bands:
            raise HarnessError(f"checkpoint {self.id} ({self.path.name}) has no band for weight class "
                               f"{band_class!r} (it has: {', '.join(self.bands)})")
        return {k: v for k, v in self.bands[band_class].items() if not k.startswith("_")}


def catalogue_path() -> Path:
    """The folder the catalogue is read from."""
    import os

    d = Path(os.environ.get("LLORCH_CHECKPOINTS") or SPEC_DIR)
    if not d.is_dir():
        raise HarnessError(f"checkpoint specs not found at {d} (set LLORCH_CHECKPOINTS)")
    return d


def load_specs(ids=None) -> list[Spec]:
    specs = []
    for p in sorted(catalogue_path().glob("cp*.json")):
        try:
            d = json.loads(p.read_text())
            specs.append(Spec(
                id=str(d["id"]), name=d["name"], title=d["title"], checks=d["checks"], scope=d["scope"],
                tensors=[TensorSpec(**t) for t in d.get("tensors", [])], bands=d["bands"],
                measured=d.get("measured", {}), path=p, dump=d.get("dump", []), order=d.get("order", 0),
                **{k: bool(d.get(k, False)) for k in FACTS}))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise HarnessError(f"{p}: malformed checkpoint spec ({type(e).__name__}: {e})") from None
    specs.sort(key=lambda s: (s.order, s.id))
    if ids:
        want = [str(i) for i in ids]
        known = {s.id for s in specs} | {s.name for s in specs}
        unknown = [i for i in want if i not in known]
        if unknown:
            raise HarnessError(f"unknown checkpoint(s) {', '.join(unknown)}; known: "
                               + ", ".join(f"{s.id} ({s.name})" for s in specs))
        specs = [s for s in specs if s.id in want or s.name in want]
    return specs


def token_checkpoints() -> frozenset:
    """The ids of the checkpoints the catalogue marks token_checkpoint (coverage keyed by id, not tensor)."""
    return _token_checkpoints(str(catalogue_path()))


@functools.lru_cache(maxsize=4)
def _token_checkpoints(folder: str) -> frozenset:
    return frozenset(s.id for s in load_specs() if s.token_checkpoint)


def band_class_of(tensor_types: dict) -> str:
    """The band class of a model: the type of its 2-D weights (the coarsest, if mixed)."""
    seen = set()
    for name, t in tensor_types.items():
        if name.endswith("_norm.weight") or name.endswith("norm.weight"):
            continue
        if t not in BAND_CLASS:
            raise HarnessError(f"weight type {t} of tensor {name} has no band class (known: {', '.join(BAND_CLASS)})")
        seen.add(BAND_CLASS[t])
    if not seen:
        return "F32"
    return max(seen, key=CLASS_ORDER.index)


def greedy_band(band: dict, n: int) -> dict:
    """A greedy-text band asking for an equal prefix longer than the run cannot be met: it asks for all n."""
    if "equal_prefix" in band and band["equal_prefix"] > n:
        return {**band, "equal_prefix": n}
    return band


STORAGE_CLASS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def engine_band_class(engine) -> str:
    """Band class of a loaded engine: its weight types, made coarser by a reduced --weight-dtype storage."""
    bc = band_class_of(engine.tensor_types)
    store = engine.weights_info().get("storage", "float32")
    return coarser(bc, STORAGE_CLASS.get(store, "F32"))


def on_gpu(band_class: str) -> str:
    """The band class of a comparison whose llama.cpp side ran its layers on the GPU backend."""
    return band_class if band_class.endswith(GPU) else band_class + GPU


def coarser(a: str, b: str) -> str:
    """The coarser of two band classes; on the GPU backend where either is."""
    base = max(a.removesuffix(GPU), b.removesuffix(GPU), key=CLASS_ORDER.index)
    return on_gpu(base) if a.endswith(GPU) or b.endswith(GPU) else base


# -- local (teacher-forced) bands: per declared arithmetic, calibrated (local_bands.json) -----
def declaration(engine, subject_arithmetic: dict | None = None) -> str:
    """The arithmetic a local comparison reproduces: the reference engine's numerics and K/V cache type, e.g.
    'exact/float32', 'ggml/float16'; '+flash_attn' when the subject declares flash attention (a fused attention whose
    f16 arithmetic the reference does not reproduce: its bands are its own)."""
    fa = bool(((subject_arithmetic or {}).get("settings") or {}).get("flash_attn"))
    return f"{engine.numerics}/{engine.kv_dtype}" + ("+flash_attn" if fa else "")


@functools.lru_cache(maxsize=2)
def _local_bands(path: str) -> dict:
    return json.loads(Path(path).read_text())


def local_band(decl: str, tensor: str) -> dict:
    """The band a local error must stay inside, for this declaration and tensor."""
    bands = _local_bands(str(catalogue_path() / "local_bands.json"))["bands"]
    if decl not in bands:
        raise HarnessError(f"no local bands for the arithmetic {decl!r} (calibrated: {', '.join(bands)}); "
                           f"calibrate them with: python tools/local_sensitivity.py calibrate")
    b = bands[decl]
    return b.get(tensor, b["default"])
