"""Checkpoint 6 (swiglu) against llama.cpp, live. Spec: checkpoints/cp06_swiglu.json"""
import planted_bugs
import pytest
from checkpoint_asserts import N_LAYERS, assert_first_divergence, assert_in_band

CP = "6"


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_f32_copy(diff_f32, layer):
    assert_in_band(diff_f32, CP, layer)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_gate_up_swapped_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.gate_up_swapped), "6", 0)
