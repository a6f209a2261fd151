"""Checkpoint 9 (last_token_logits) against llama.cpp, live. Spec: checkpoints/cp09_last_token_logits.json"""

import planted_bugs
from checkpoint_asserts import assert_first_divergence, assert_in_band

CP = "9"


def test_f32_copy(diff_f32):
    assert_in_band(diff_f32, CP)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_last_row_off_by_one_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.last_row_off_by_one), "9", None)
