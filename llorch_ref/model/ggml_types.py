"""ggml's tensor types as GGUF files number them: name, weights per block and bytes per block.

gguf-py's GGML_QUANT_SIZES and GGMLQuantizationType, restated: importing the gguf package for them imports its
writer, vocabulary and YAML-metadata modules too (26 ms of the default model's 0.28 s load on Zen 5), where a load
of a file whose matrices all run on the numba kernels needs gguf-py for nothing else. tests/test_loader.py holds
this table to gguf-py's, type by type; a type number missing here is looked up in gguf-py (`ggml_type`).
"""
from __future__ import annotations

from enum import IntEnum

# GGUF type number -> (name, weights per block, bytes per block), gguf-py 0.19's
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
          7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
          11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
          15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
          19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
          23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
          28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
          35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18)}

# The types as an IntEnum like gguf-py's (a member equals and hashes as its number, so gguf-py's functions and
# tables take it), and their block sizes by type
GGMLType = IntEnum("GGMLType", {name: number for number, (name, _, _) in _TYPES.items()})
SIZES = {GGMLType(number): (block, size) for number, (_, block, size) in _TYPES.items()}


def ggml_type(number: int):
    """A GGUF type number -> (its type, (weights per block, bytes per block)); one this table lacks from gguf-py
    (a newer type); ValueError if neither knows it."""
    if number in _TYPES:
        t = GGMLType(number)
        return t, SIZES[t]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType(number)
    return t, GGML_QUANT_SIZES[t]


def block_size(qtype: str) -> tuple[int, int]:
    """ggml type name -> (weights per block, bytes per block) (every type gguf-py can read)."""
    if qtype in GGMLType.__members__:
        return SIZES[GGMLType[qtype]]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
