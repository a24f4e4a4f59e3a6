"""The resume check's exact mode on CUDA (issue 53): a run whose resume is judged bit for bit on CUDA asks its
training children for deterministic kernels (core/protocol/determinism.py), applied in the child
(core/child/determinism.py) and said in the tier's reason in the record. No GPU here: the child's switches are checked
on the CPU build of torch (they are process-wide settings), the CUDA run itself is unverified."""

from __future__ import annotations

import subprocess
import sys

from core.protocol.determinism import CUBLAS_WORKSPACE_CONFIG, DETERMINISTIC_ENV, EXACT_MODE_WORDS
from core.spec import RunSpec
from core.stages import childproc
from core.stages.childproc import launch_options
from core.stages.noise import deterministic_kernels, required_tier
from tests.paths import REPO


def test_only_a_bit_exact_judgement_on_cuda_asks_for_deterministic_kernels():
    assert deterministic_kernels("cuda:0", resume_tier="exact")
    assert deterministic_kernels("cuda:1", noise="off")
    assert not deterministic_kernels("cuda:0")  # twins measure CUDA's noise instead
    assert not deterministic_kernels("cpu", resume_tier="exact")  # the CPU's kernels are bit-exact already
    assert EXACT_MODE_WORDS in required_tier("cuda:0", "bf16", "exact").why
    assert EXACT_MODE_WORDS in required_tier("cuda:0", "bf16", noise="off").why
    assert EXACT_MODE_WORDS not in required_tier("cpu", "bf16", "exact").why
    assert required_tier("cuda:0", "bf16").method == "twin"


def test_the_launch_of_an_exact_run_on_cuda_carries_the_mode_into_the_childs_environment(tmp_path, monkeypatch):
    exact = RunSpec.build(mode="lora", devices="0", accept_resume_tier="exact")
    assert launch_options(exact, ["cuda:0"]).deterministic
    assert not launch_options(RunSpec.build(mode="lora", devices="0"), ["cuda:0"]).deterministic
    assert not launch_options(RunSpec.build(mode="lora", devices="cpu", accept_resume_tier="exact"), ["cpu"]).deterministic
    assert not launch_options(RunSpec.build(mode="inference", devices="0", resume_noise="off"),
                              ["cuda:0"]).deterministic  # nothing trains, nothing resumes
    seen = {}

    def start(module, argv, log, env):  # the fork server's start: what the child would get
        seen.update(env)
        return "forked"

    monkeypatch.setattr(childproc.forkserver, "start", start)
    from core.protocol.job import worker_job

    job = worker_job(exact, "train", tmp_path, "cuda:0", ["cuda:0"])
    childproc.start_child("t", tmp_path / "job", job, launch_options(exact, ["cuda:0"]))
    assert seen[DETERMINISTIC_ENV] == "1" and seen["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    seen.clear()
    childproc.start_child("t", tmp_path / "job2", job, launch_options(exact, ["cpu"]))
    assert DETERMINISTIC_ENV not in seen


def test_the_child_turns_on_deterministic_algorithms_and_one_attention_backend_when_asked():
    code = ("import torch; from core.child.determinism import apply_determinism as a; "
            "print(a({}), torch.are_deterministic_algorithms_enabled()); "
            f"d = a({{'{DETERMINISTIC_ENV}': '1'}}); "
            "print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, "
            "torch.backends.cudnn.benchmark, torch.backends.cuda.flash_sdp_enabled(), "
            "torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(), len(d) >= 4)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[] False", "True True False False False True True"], done.stdout
    assert "gpuaccept: exact mode: torch.use_deterministic_algorithms(True)" in done.stderr
