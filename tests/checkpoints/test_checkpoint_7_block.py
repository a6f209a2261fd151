"""Checkpoint 7 (block) against llama.cpp, live. Spec: checkpoints/cp07_block.json"""
import planted_bugs
import pytest
from checkpoint_asserts import N_LAYERS, assert_first_divergence, assert_in_band

CP = "7"


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_f32_copy(diff_f32, layer):
    assert_in_band(diff_f32, CP, layer)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_missing_ffn_residual_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.missing_ffn_residual), "7", 0)
