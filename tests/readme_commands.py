"""The commands the README tells a user to type: every line of its ```sh blocks, in order, and how a test runs one
exactly as written.

Which test runs which line (each as written, from a stand-in for the repository's root: :func:`user_root`):

- the headless acceptance and the signing and verifying lines after it: tests/integration/test_e2e_embedded.py (its
  headless run is this line; the wizard beside it must write the same record);
- the command-mode line (it opens the wizard): walked with keys in tmux by tests/integration/test_tmux.py;
- ``make run``'s wizard: walked in tmux by tests/integration/test_tmux.py; ``make test``: the suite itself;
- the rest: tests/integration/test_readme.py, which also checks that every line has its test.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO

README = REPO / "README.md"
VENV = REPO / ".venv"
#: the exit status a README command has when it does what the README says (0 unless listed); the README says why
EXIT = {
    ".venv/bin/gpuaccept verify runs/quickstart/*/record.toml": 7,  # signed, the signer not checked (no allowed signers)
}

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")


def readme_commands(path: Path = README) -> list[str]:
    """Every command line of the ```sh (or ```bash, ```shell) blocks of ``path``, in order: a line ending in a
    backslash is joined with the next (the backslash and the newline dropped, as the shell does); blank lines and
    lines that are only a comment are left out. A command keeps its words as written (quotes included): split it
    with :func:`shlex.split`."""
    commands: list[str] = []
    fence: str | None = None  # the fence of the sh block we are in
    other: str | None = None  # the fence of another block (its lines are not commands)
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        match = _FENCE.match(line)
        if other is not None:
            if match and match.group(1)[0] == other[0] and len(match.group(1)) >= len(other) and not match.group(2):
                other = None
            continue
        if fence is None:
            if match:
                if match.group(2).lower() in ("sh", "bash", "shell"):
                    fence = match.group(1)
                else:
                    other = match.group(1)
            continue
        if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2):
            if pending:
                raise ValueError(f"{path}: a sh block ends in a line continuation: {pending!r}")
            fence = None
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line = pending + line
        pending = ""
        if line and not line.startswith("#"):
            commands.append(line)
    if fence is not None:
        raise ValueError(f"{path}: a sh block is not closed")
    return commands


def headless_line() -> str:
    """The README's headless acceptance (step 3)."""
    (line,) = [c for c in readme_commands() if c.startswith(".venv/bin/gpuaccept run --headless")]
    return line


def command_mode_line() -> str:
    """The README's command-mode example (step 4): the one line that runs ``.venv/bin/gpuaccept`` with ``--command``."""
    (line,) = [c for c in readme_commands() if c.startswith(".venv/bin/gpuaccept") and "--command" in shlex.split(c)]
    return line


def signing_lines() -> list[str]:
    """The README's step 5: the key, the signature and the verification of the headless run's record."""
    return [c for c in readme_commands() if c.startswith("ssh-keygen") or c.startswith(".venv/bin/gpuaccept sign")
            or c.startswith(".venv/bin/gpuaccept verify")]


def user_root(folder: Path) -> Path:
    """``folder`` made a stand-in for the repository's root after ``make run``: its ``.venv`` and ``examples`` are
    links to the repository's own, so the README's paths are used unmapped, and ``runs/`` lands in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (".venv", "examples"):
        if not (folder / name).exists():
            (folder / name).symlink_to(REPO / name, target_is_directory=True)
    return folder


def user_env() -> dict[str, str]:
    """This process's environment as a user's shell has it without the venv activated: a command that runs a bare
    ``python`` gets the system's (the README's command mode once did, and failed with "No module named 'torch'")."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    venv_bins = {os.path.realpath(b) for b in (VENV / "bin", Path(sys.prefix) / "bin")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) not in venv_bins)
    return env


def words_of(line: str, cwd: Path) -> list[str]:
    """``line`` split as the shell splits it, with a word holding ``*`` expanded as the shell expands it (sorted
    matches relative to ``cwd``; no match leaves the word as written). ``~`` and variables are not expanded: the
    README must not need them."""
    out: list[str] = []
    for word in shlex.split(line):
        matches = sorted(glob.glob(word, root_dir=cwd)) if any(c in word for c in "*?[") else []
        out.extend(matches or [word])
    return out


def run_as_written(line: str, cwd: Path, timeout_s: float = 900) -> subprocess.CompletedProcess:
    """Run one README line as a user types it in ``cwd`` (no shell, the venv not activated); the result, whatever
    its exit status (compare it with ``EXIT.get(line, 0)``)."""
    return subprocess.run(words_of(line, cwd), cwd=cwd, env=user_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout_s)


if __name__ == "__main__":  # print them, one a line
    print("\n".join(readme_commands()))
