"""The planted bugs of the checkpoint suite, under the local comparison on quantized weights (Q8_0): each one
planted in a subject engine is named at its own checkpoint by local error, while the reference (a clean
engine, exact arithmetic) runs the same blocks. The patches are undone before the reference runs, since
they reach module-level functions both engines share."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import llorch_ref
from llorch_ref.checkpoints import engine_band_class
from llorch_ref.harness.compare import compare_dumps
from llorch_ref.references.llorch import record_engine

sys.path.insert(0, str(Path(__file__).parent / "checkpoints"))
import planted_bugs as B  # noqa: E402


def rope_kernel_swapped(mp, eng):            # cp1B: the RoPE kernel rotates half-split pairs on adjacent rows
    orig = B.layers.rope                     # (the config, and so the dump's layout declaration, stay right)
    mp.setattr(B.layers, "rope", lambda xp, x, cos, sin, style: orig(xp, x, cos, sin,
                                                                      "neox" if style == "adjacent" else "adjacent"))


CASES = [(B.wrong_rms_epsilon, "1"), (rope_kernel_swapped, "1B"), (B.off_by_one_position, "1B"),
         (B.unpermuted_q_rows, "2"), (B.missing_gqa_repeat, "4"), (B.wrong_attention_scale, "4"),
         (B.heads_merged_wrong, "5"), (B.gate_up_swapped, "6"), (B.missing_ffn_residual, "7"),
         (B.final_norm_without_weight, "8")]


@pytest.fixture(scope="module")
def q8(tiny):
    return tiny(weight_type="Q8_0", n_layers=3, d_model=128, d_ff=192, vocab="bpe")


@pytest.mark.parametrize("bug,checkpoint", CASES, ids=[c[0].__name__ for c in CASES])
def test_planted_bug_is_named_by_local_error_on_quantized_weights(q8, bug, checkpoint, monkeypatch):
    ref_engine = llorch_ref.load(q8, weights="eager")
    subject = llorch_ref.load(q8, weights="eager")
    ids = ref_engine.tokenizer.encode("Once upon a time, there was")
    bug(monkeypatch, subject)
    sub = record_engine(subject, ids, n_greedy=4)
    monkeypatch.undo()
    res = compare_dumps(sub, record_engine(ref_engine, ids, n_greedy=4), ref_engine.config,
                        engine_band_class(ref_engine), local_engine=ref_engine)
    fd = res.first_divergence
    assert fd is not None and fd["checkpoint"] == checkpoint and fd["by"] == "local error", fd
