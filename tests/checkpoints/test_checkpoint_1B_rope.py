"""Checkpoint 1B (rope) against llama.cpp, live. Spec: checkpoints/cp01B_rope.json"""
import planted_bugs
import pytest
from checkpoint_asserts import N_LAYERS, assert_first_divergence, assert_in_band

CP = "1B"


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_f32_copy(diff_f32, layer):
    assert_in_band(diff_f32, CP, layer)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_swapped_rope_style_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.swapped_rope_style), "1B", 0)


def test_planted_off_by_one_position_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.off_by_one_position), "1B", 0)
