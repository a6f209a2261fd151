"""Checkpoint 4 (attention_scores) against llama.cpp, live. Spec: checkpoints/cp04_attention_scores.json"""
import planted_bugs
import pytest
from checkpoint_asserts import N_LAYERS, assert_first_divergence, assert_in_band

CP = "4"


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_f32_copy(diff_f32, layer):
    assert_in_band(diff_f32, CP, layer)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_missing_gqa_repeat_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.missing_gqa_repeat), "4", 0)


def test_planted_wrong_attention_scale_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.wrong_attention_scale), "4", 0)
