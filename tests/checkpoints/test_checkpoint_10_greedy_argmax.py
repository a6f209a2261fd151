"""Checkpoint 10 (greedy_argmax) against llama.cpp, live. Spec: checkpoints/cp10_greedy_argmax.json"""

import planted_bugs
from checkpoint_asserts import assert_first_divergence, assert_in_band

CP = "10"


def test_f32_copy(diff_f32):
    assert_in_band(diff_f32, CP)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_greedy_takes_runner_up_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.greedy_takes_runner_up, n_greedy=8), "10", None)
