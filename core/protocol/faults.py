"""Faults planted on purpose in the resume check's runs (tests only): what the check exists to catch.

``GPUACCEPT_TEST_FAULT=<name>`` in gpuaccept's environment makes its training child commit one of these bugs, each one a
way real resumes go wrong; the resume check must fail, naming it. Records made with one say so
(``environment.test_fault``). The user's own command (command mode) is faulted by its own flags instead
(``examples/train_plain.py`` and ``examples/train_hf.py`` ``--fault``).

The faults act in the resumed run, but for ``other_run``, which acts in the interrupted run (the run whose checkpoint is
resumed), so that the checkpoint resumed from is another run's.

:data:`BENIGN` differences are planted the same way but are no fault: a correct resume with them must pass.
"""

from __future__ import annotations

import os

#: the environment variable naming the fault (unset or empty: none)
FAULT_ENV = "GPUACCEPT_TEST_FAULT"
#: every fault, with what it does
FAULTS: dict[str, str] = {
    "fresh_optimizer": "the optimizer's state is not restored: AdamW starts again from zero moments and step 0",
    "scheduler_restart": "the learning-rate schedule is not restored: it restarts from its first step",
    "rng_not_restored": "the random generators are not restored from the checkpoint (shows with dropout on)",
    "data_restart": "the data order restarts from the first sample (Trainer's ignore_data_skip)",
    "other_run": "the checkpoint resumed from is another run's: the run that wrote it trained with seed + 1",
    "adapters_not_restored": "the base model is loaded but the LoRA adapters are not restored (they keep their "
                             "initial values)",
}


#: differences a correct resume may have, planted like the faults (the check must pass them), with what they do
BENIGN: dict[str, str] = {
    "one_ulp": "every trainable parameter of the resumed run moves by one unit in the last place before its first "
               "step (the twins' nudge): the smallest difference a process that loaded a checkpoint can have",
}


def active(role: str) -> str | None:
    """The fault this process must commit in ``role`` (``resumed``; ``interrupted`` for ``other_run``), or None.

    Raises:
        ValueError: ``GPUACCEPT_TEST_FAULT`` names no fault (the known ones are listed)."""
    name = os.environ.get(FAULT_ENV, "").strip()
    if not name:
        return None
    if name not in FAULTS and name not in BENIGN:
        raise ValueError(f"{FAULT_ENV}={name}: not a fault; one of {', '.join([*FAULTS, *BENIGN])}")
    wanted = "interrupted" if name == "other_run" else "resumed"
    return name if role == wanted else None
