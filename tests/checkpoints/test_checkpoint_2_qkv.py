"""Checkpoint 2 (qkv) against llama.cpp, live. Spec: checkpoints/cp02_qkv.json"""
import planted_bugs
import pytest
from checkpoint_asserts import N_LAYERS, assert_first_divergence, assert_in_band

CP = "2"


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_f32_copy(diff_f32, layer):
    assert_in_band(diff_f32, CP, layer)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_unpermuted_q_rows_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.unpermuted_q_rows), "2", 0)
