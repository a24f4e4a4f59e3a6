"""Every command of the README's quick start, run as written (issue 34).

The README's ```sh blocks (tests/readme_commands.py) are run in order, each split with :func:`shlex.split` and
started without a shell, exactly as a new user types them from the repository's root after ``make run``:

- **where**: a temporary folder standing in for the repository's root. Its ``.venv`` and ``examples`` are links to
  the repository's own, so ``.venv/bin/gpuaccept``, ``.venv/bin/python`` and ``examples/train_plain.py`` are the
  README's own paths, unmapped; ``runs/`` (the run folders, the quick start's throwaway key) lands in the temporary
  folder and nothing is left in the repository.
- **the environment**: the test's, without the virtual environment on ``PATH`` and without ``VIRTUAL_ENV``, as for
  a user who never activated it: a command that runs a bare ``python`` gets the system's (the README's command mode
  once did, and failed with "No module named 'torch'").
- **the one shell feature used**: a word holding ``*`` is expanded as the shell expands it (sorted matches; no match
  leaves the word as written). ``~`` and variables are not: the README must not need them.

The long runs are not repeated here: :func:`not_run_here` names the test that runs each of them as written (the
headless acceptance and its signing: test_e2e_embedded.py; the wizard lines: test_tmux.py), and
:func:`test_readme_lists_what_it_runs` fails for a line that starts the wizard and no walk takes.
"""

from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path

import pytest

from tests.paths import REPO
from tests.readme_commands import (
    EXIT,
    VENV,
    command_mode_line,
    headless_line,
    readme_commands,
    run_as_written,
    signing_lines,
    user_root,
)

pytestmark = pytest.mark.slow


def not_run_here() -> dict[str, str]:
    """The README's commands this test does not run, each with the test that runs it (or why none does)."""
    elsewhere = {
        "make run": "the install, then the interactive wizard: walked cold with keys in tmux by "
                    "tests/integration/test_tmux.py",
        "make test": "the test suite itself",
        headless_line(): "run as written by tests/integration/test_e2e_embedded.py (the wizard beside it must write "
                         "the same record)",
        command_mode_line(): "opens the wizard: walked as written, with keys, in tmux by tests/integration/test_tmux.py",
    }
    for line in signing_lines():
        elsewhere[line] = "run as written on the headless run's record by tests/integration/test_e2e_embedded.py"
    return elsewhere


def _wizard(words: list[str]) -> bool:
    """The command opens the interactive wizard: ``gpuaccept`` alone, or ``gpuaccept run`` without ``--headless``."""
    if not words or Path(words[0]).name != "gpuaccept":
        return False
    return len(words) == 1 or (words[1] == "run" and "--headless" not in words)


def test_readme_lists_what_it_runs():
    """The README's commands parse, each has the test that runs it, exactly one runs command mode, and no line holds
    shell syntax this test (and a user pasting a line) would read differently."""
    commands = readme_commands()
    assert "make run" in commands and "make test" in commands, "the README keeps its two set-up commands"
    elsewhere = not_run_here()
    for line in commands:
        words = shlex.split(line)
        assert "#" not in words and not any(w in ("|", "&&", ";", ">", "<", "$") for w in words), line
        assert not any(w.startswith(("~", "$")) for w in words), f"{line}: ~ and $VARIABLE are not expanded here"
        if _wizard(words):
            assert line in elsewhere, f"{line}: starts the wizard; a tmux walk must take it"
    assert "--command" in shlex.split(command_mode_line()) and "--headless" not in shlex.split(command_mode_line())
    assert set(elsewhere) <= set(commands), set(elsewhere) - set(commands)
    assert set(EXIT) <= set(commands), set(EXIT) - set(commands)
    assert len(signing_lines()) == 3, signing_lines()


def test_the_other_readme_commands_run_as_written(tmp_path):
    if not (VENV / "bin" / "gpuaccept").is_file():
        pytest.skip("the README's commands name .venv/bin/: make install makes it")
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed (.ci/run installs it)")
    root = user_root(tmp_path / "repo")
    elsewhere = not_run_here()
    ran = []
    for line in readme_commands():
        if line in elsewhere:
            continue
        started = time.monotonic()
        done = run_as_written(line, root)
        ran.append((round(time.monotonic() - started, 1), line[:60]))
        expected = EXIT.get(line, 0)
        assert done.returncode == expected, (
            f"README command exited {done.returncode}, not {expected}:\n{line}\n--- stdout (end)\n"
            f"{done.stdout[-4000:]}\n--- stderr (end)\n{done.stderr[-4000:]}")
    assert ran, "every README command is run by another test: this one has nothing left"
    print("seconds per README command:", ran)
    assert not (REPO / "examples" / "runs").exists()


def test_the_quick_starts_words_and_timings_are_of_its_own_commands():
    """Issue 51: the table timed `--steps 6` beside a line with `--steps 4`, and step 4 read as if it ran by itself
    while, without --headless, it opens the wizard at Mode."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text.split("## The first minutes on a fresh machine", 1)[1].split("**1.", 1)[0]
    lines = readme_commands()
    for steps in re.findall(r"--steps (\d+)", table):  # a timing that names its flags names the line's own
        assert any(f"--steps {steps}" in line for line in lines), f"the table times --steps {steps}: no line has it"
    step4 = text.split("**4. ", 1)[1].split("**5. ", 1)[0]
    if "--headless" not in shlex.split(command_mode_line()):
        assert "opens the wizard" in step4 and "Ctrl+N" in step4, "step 4 opens the wizard: it must say so, with keys"
