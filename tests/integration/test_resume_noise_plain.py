"""Command mode's resume under the test jitter, the plain PyTorch loop (examples/train_plain.py, measured from outside): a correct resume
passes within its twin's noise, and each fault the script can commit (``--fault``) fails, naming it
(tests/command_faults.py; gpuaccept's own recipe: test_resume_noise.py)."""

from __future__ import annotations

import pytest

from tests.command_faults import COMMAND_FAULTS, assert_fails_naming, assert_passes, reference, resume

EXAMPLE = "plain"


@pytest.fixture(scope="module")
def found(tiny_model_dir, tmp_path_factory):
    run = reference(EXAMPLE, tiny_model_dir, tmp_path_factory.mktemp(EXAMPLE))
    yield run
    run[1].close()
    run[3].close()


def test_a_correct_resume_passes_within_the_twins_noise(found, tmp_path, monkeypatch):
    assert_passes(resume(found, EXAMPLE, None, tmp_path, monkeypatch))


@pytest.mark.parametrize("fault", sorted(COMMAND_FAULTS[EXAMPLE]))
def test_each_planted_fault_fails_the_resume_naming_it(fault, found, tmp_path, monkeypatch):
    assert_fails_naming(resume(found, EXAMPLE, fault, tmp_path, monkeypatch), EXAMPLE, fault)
