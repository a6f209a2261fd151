"""verify's re-run of a black-box bundle: the figures it holds against the bundle's (harness.verify.figure_holds)."""
from llorch_ref.harness.verify import figure_holds

ROW = {"ref_logprob": -0.62, "engine_logprob": -0.65}


def test_a_margin_holds_through_the_reference_s_float32_noise_and_not_past_it():
    # the same margin from one BLAS thread and from two (AMD EPYC, OpenBLAS Haswell kernels): 0.088562 / 0.0885735
    assert figure_holds("margin", 0.088562, 0.0885735, ROW)
    assert not figure_holds("margin", 0.088562, 0.0896, ROW)              # 1e-3 moved: an edited bundle
    assert figure_holds("kld", 1.0e-3, 1.01e-3, ROW)
    assert not figure_holds("kld", 1.0e-3, 1.5e-3, ROW)


def test_a_log_probability_is_held_to_its_own_size():
    assert figure_holds("ref_logprob", -2.0, -2.0001, ROW)
    assert not figure_holds("ref_logprob", -2.0, -2.01, ROW)
    assert not figure_holds("engine_logprob", -0.65, -0.90, ROW)         # the test bundle's planted 0.25 edit
    assert figure_holds("rank", 3, 3, ROW) and not figure_holds("rank", 3, 4, ROW)
