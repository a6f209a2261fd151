"""Checkpoint 12 (greedy_text) against llama.cpp, live. Spec: checkpoints/cp12_greedy_text.json"""

import planted_bugs
from checkpoint_asserts import assert_first_divergence, assert_in_band

CP = "12"


def test_f32_copy(diff_f32):
    assert_in_band(diff_f32, CP)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_decode_position_skips_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.decode_position_skips, n_greedy=16), "12", None)
