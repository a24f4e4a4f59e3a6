"""What the record says of the command itself: its words, its program, and the script files it runs, each with its
sha256 and the git commit of its folder (so a reader can tell which code was accepted).

A script file is any word of the training, resume or evaluation command (placeholders excluded) that names a regular
file, relative to the command's ``workdir`` or absolute, except the program when it was found on ``PATH`` or is a
compiled executable (``python``, ``torchrun``): ``train.py``, ``configs/sft.yaml``, ``./launch.sh``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from core.commandspec import CommandSpec, find_program
from core.protocol.manifest import sha256_file


def script_files(spec: CommandSpec) -> list[Path]:
    """The script files the command names (see the module docstring), resolved, each once, in order of appearance."""
    workdir = spec.workdir_path
    words = spec.words() + spec.resume_words() + (spec.eval.split() if spec.eval not in ("perplexity", "none") else [])
    seen: list[Path] = []
    for i, word in enumerate(words):
        if "{" in word or not word or word.startswith("-") and "=" not in word:
            continue
        candidate = word.split("=", 1)[1] if word.startswith("-") else word
        path = (workdir / candidate).expanduser()
        try:
            if not path.is_file():
                continue
        except OSError:
            continue
        path = path.resolve()
        if (i == 0 or word == words[0]) and ("/" not in word or _compiled(path)):
            continue  # the program itself, found on PATH (python, torchrun) or a binary
        if path not in seen:
            seen.append(path)
    return seen


def _compiled(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def git_state(path: Path) -> dict[str, Any]:
    """The git commit of the repository holding ``path``, whether ``path`` differs from it (or is untracked), and the
    repository's root; ``{"git": "not a git repository"}`` (or why git could not say) otherwise."""
    folder = path.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        root = git("rev-parse", "--show-toplevel")
        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--", path.name)
    except FileNotFoundError:
        return {"git": "git is not installed here"}
    except subprocess.CalledProcessError:
        return {"git": "not a git repository (or one without a commit)"}
    except subprocess.TimeoutExpired:
        return {"git": "git did not answer within 10 s"}
    return {"git_root": root, "git_commit": commit, "git_dirty": bool(status),
            "git_status": status.split(" ", 1)[0] if status else "unchanged"}


#: run by the interpreter of a console script: the distribution whose console_scripts entry point has that name
_WHICH_PACKAGE = """
import sys, importlib.metadata as m
for d in m.distributions():
    if any(e.group == "console_scripts" and e.name == sys.argv[1] for e in d.entry_points):
        print(d.metadata["Name"]); print(d.version); break
"""


def program_package(program: str) -> dict[str, str]:
    """The Python package that installed ``program`` (a console script: ``litgpt``, ``trl``, ``tune``,
    ``llamafactory-cli``), as the interpreter of its ``#!`` line reports it (``importlib.metadata``: the distribution
    whose console_scripts entry point has the program's name): ``{"name", "version", "python"}``; ``{"package": why
    not}`` for a binary, a shell script or a program no distribution declares."""
    path = Path(program)
    try:
        with open(path, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError as exc:
        return {"package": f"not read: {exc}"}
    python = first[2:].strip().split()[0] if first.startswith("#!") and first[2:].strip() else ""
    if "python" not in Path(python).name:
        return {"package": "not a Python console script (no python on its #! line)"}
    try:
        done = subprocess.run([python, "-c", _WHICH_PACKAGE, path.name], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"package": f"its interpreter {python} did not answer: {exc}"}
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2:
        return {"package": f"no distribution of {python} declares the console script {path.name}"}
    return {"name": lines[0], "version": lines[1], "python": python}


def command_table(spec: CommandSpec, argv: list[str] | None, resume_argv: list[str] | None,
                  env_added: dict[str, str] | None = None) -> dict[str, Any]:
    """The record's ``command`` table: the words as run, the program's path and the package that installed it (the
    trainer and its version: :func:`program_package`), the workdir, the variables gpuaccept added, every script file
    (a trainer's config file too) with its sha256, size and git state."""
    scripts = []
    for path in script_files(spec):
        try:
            scripts.append({"path": str(path), "sha256": sha256_file(path), "size_bytes": path.stat().st_size,
                            **git_state(path)})
        except OSError as exc:
            scripts.append({"path": str(path), "error": str(exc)})
    program = find_program(spec.words()[0], spec.workdir_path, spec.env) or "not found"
    table: dict[str, Any] = {"provenance": "measured",
                             "method": "the words run (no shell), the program found on PATH, sha256 of each script "
                                       "file the command names and git's commit of its folder",
                             "train": spec.train, "resume": spec.resume, "workdir": str(spec.workdir_path),
                             "program": program, "scripts": scripts}
    if program != "not found":
        table["program_package"] = program_package(program)
    if argv:
        table["train_argv"] = list(argv)
    if resume_argv:
        table["resume_argv"] = list(resume_argv)
    if env_added:
        table["env_added"] = dict(env_added)
    return table
