"""Checkpoint 11 (softmax_probs) against llama.cpp, live. Spec: checkpoints/cp11_softmax_probs.json"""

import planted_bugs
from checkpoint_asserts import assert_first_divergence, assert_in_band

CP = "11"


def test_f32_copy(diff_f32):
    assert_in_band(diff_f32, CP)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_softmax_wrong_axis_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.softmax_wrong_axis, n_greedy=8), "11", None)
