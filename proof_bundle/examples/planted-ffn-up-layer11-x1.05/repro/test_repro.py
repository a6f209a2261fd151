"""The first divergence of proof run planted-ffn-up-layer11-x1.05: checkpoint 6, ffn_swiglu, layer 11.

The subject's output of this one operation, against llorch-ref's operation on the subject's own inputs, is
outside its band. Needs numpy and llorch-ref only (not the subject engine):

    pytest repro/
"""
from pathlib import Path

from llorch_ref.harness.repro import check_reference, check_subject, load

HERE = Path(__file__).parent


def test_reference_operation_gives_the_stored_output():
    check_reference(load(HERE))


def test_subject_output_inside_the_band():
    check_subject(load(HERE))
