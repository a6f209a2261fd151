"""Checkpoint 3 (kv_cache) against llama.cpp, live. Spec: checkpoints/cp03_kv_cache.json"""
import planted_bugs
import pytest
from checkpoint_asserts import N_LAYERS, assert_first_divergence, assert_in_band

CP = "3"


@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_f32_copy(diff_f32, layer):
    assert_in_band(diff_f32, CP, layer)


def test_q4_1_original(diff_q41):
    assert_in_band(diff_q41, CP)


def test_planted_stale_cache_entries_is_caught(planted):
    assert_first_divergence(planted(planted_bugs.stale_cache_entries), "3", 0)
