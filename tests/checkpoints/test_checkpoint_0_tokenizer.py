"""Checkpoint 0 (tokenizer) against llama.cpp, live. Spec: checkpoints/cp00_tokenizer.json"""

import planted_bugs
from checkpoint_asserts import assert_first_divergence, assert_in_band

CP = "0"


def test_f32_copy(diff_f32):
    assert_in_band(diff_f32, CP)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_add_bos_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.add_bos), "0", None)
