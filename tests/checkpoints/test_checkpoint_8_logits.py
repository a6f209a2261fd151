"""Checkpoint 8 (logits) against llama.cpp, live. Spec: checkpoints/cp08_logits.json"""

import planted_bugs
from checkpoint_asserts import assert_first_divergence, assert_in_band

CP = "8"


def test_f32_copy(diff_f32):
    assert_in_band(diff_f32, CP)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_final_norm_without_weight_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.final_norm_without_weight), "8", None)
