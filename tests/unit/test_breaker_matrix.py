"""Issue 52's breaker's matrix: every file gpuaccept reads, made hostile in every way a breaker tried, through the real
CLI (``tui.cli.main``, in-process: no model runs).

Inputs (what reads it): a TOML spec (``plan SPEC``), a trainer's YAML of each format (``plan CONFIG``), a record
(``verify``), a record's signature (``verify`` beside it), an allowed-signers file (``verify --allowed-signers``), the
data (``plan --data``) and the quiz's record (``quiz``). Kinds: a FIFO, a device, a directory, a symbolic link loop, an
empty file, binary bytes, a huge file (sparse, 2 GiB), a "billion laughs" of YAML aliases, nesting 50,000 deep, an
integer of 5,000 digits, a value of the wrong type, and text that is not UTF-8.

Every cell ends in gpuaccept's named answer for bad input: exit 2, or verify's own codes (5: the record is not a valid
record; 4: the signature is bad), in under 5 s and under 200 MB of Python allocations, with a message that names the
file, and never an internal error or a traceback. A FIFO is never opened (a read would block: an alarm fails the cell
at 10 s instead of hanging the suite).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.records import path_of
from tui.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
#: 858 bytes of nested aliases that expand to 9^9 strings (the issue's reproduction)
BOMB = "".join(f"{k}: &{k} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
               for p, k in zip(["", *"abcdefgh"], "abcdefghi"))
DEEP = 50_000
DIGITS = "9" * 5000
SECONDS = 5.0
PYTHON_BYTES = 200 * 2**20


@dataclass(frozen=True)
class Input:
    """One file gpuaccept reads: its name, the text a good one holds (the hostile kinds are made from it), how the CLI
    is asked to read it, and the exit code that names it bad."""

    name: str
    argv: Callable[[Path, Path], list[str]]  # (the hostile file, the test's folder) -> argv
    code: int
    good: str = ""
    wrong_type: str = ""
    huge_int: str = ""
    deep: str = ""
    #: a kind answered with another code (``verify`` of a directory looks for the records below it: 2 when none)
    codes: tuple[tuple[str, int], ...] = ()

    def code_for(self, kind: str) -> int:
        return dict(self.codes).get(kind, self.code)


def _yaml_input(file: str, batch_key: str) -> Input:
    good = (CONFIGS / file).read_text(encoding="utf-8").replace("MODEL", "smollm2-135m")
    line = re.compile(rf"^(\s*{batch_key}:).*$", re.M)
    assert line.search(good), (file, batch_key)
    return Input(file, lambda p, _: ["plan", str(p), "--devices", "1xH100"], 2, good,
                 wrong_type=line.sub(r"\1 eight", good, count=1), huge_int=line.sub(rf"\1 {DIGITS}", good, count=1),
                 deep=good + "deep: " + "[" * DEEP + "]" * DEEP + "\n")


def _record_text() -> str:
    return path_of("lora").read_text(encoding="utf-8")


def _signed(folder: Path) -> Path:
    """A good record in ``folder`` (the hostile file is its signature, or the allowed signers beside it)."""
    record = folder / "record.toml"
    if not record.exists():
        shutil.copyfile(path_of("lora"), record)
    return record


def _run_on_data(path: Path, folder: Path) -> list[str]:
    """A headless run reads and splits its data right after it finds the model, before any run folder exists (``plan``
    does not read the data). The model: the suite's tiny Llama (``folder / "model"``, linked by the test)."""
    return ["run", "--headless", "--runs-dir", str(folder / "runs"), "--model", str(folder / "model"), "--devices",
            "cpu", "--data", str(path)]


def _allowed_signers(path: Path, folder: Path) -> list[str]:
    record = _signed(folder)
    (folder / "record.toml.sig").write_text("-----BEGIN SSH SIGNATURE-----\n", encoding="utf-8")
    return ["verify", str(record), "--allowed-signers", str(path), "--identity", "grace@box"]


INPUTS = [
    Input("spec.toml", lambda p, _: ["plan", str(p)], 2, 'mode = "lora"\nbatch_size = 2\n',
          wrong_type='mode = "lora"\nbatch_size = "eight"\n', huge_int=f'mode = "lora"\nbatch_size = {DIGITS}\n',
          deep="a = " + "[" * DEEP + "]" * DEEP + "\n"),
    _yaml_input("trl_sft_qlora.yaml", "per_device_train_batch_size"),
    _yaml_input("axolotl_lora.yml", "micro_batch_size"),
    _yaml_input("torchtune_lora.yaml", "batch_size"),
    _yaml_input("litgpt_lora.yaml", "micro_batch_size"),
    _yaml_input("llamafactory_dora.yaml", "per_device_train_batch_size"),
    Input("record.toml", lambda p, _: ["verify", str(p)], 5, "", wrong_type='schema_version = "one"\nkind = 7\n',
          huge_int=f"schema_version = {DIGITS}\n", deep="a = " + "[" * DEEP + "]" * DEEP + "\n",
          codes=(("directory", 2),)),
    Input("record.toml.sig", lambda p, folder: ["verify", str(_signed(folder))], 4,
          "-----BEGIN SSH SIGNATURE-----\n", wrong_type="-----BEGIN SSH SIGNATURE-----\neight\n-----END SSH SIGNATURE-----\n",
          huge_int=f"-----BEGIN SSH SIGNATURE-----\n{DIGITS}\n-----END SSH SIGNATURE-----\n",
          deep="[" * DEEP + "]" * DEEP + "\n"),
    Input("allowed_signers", _allowed_signers, 2, "grace@box ssh-ed25519 AAAA\n",
          wrong_type="grace@box 8 eight\n", huge_int=f"grace@box ssh-ed25519 {DIGITS}\n",
          deep="grace@box " + "[" * DEEP + "]" * DEEP + "\n"),
    Input("data.jsonl", _run_on_data, 2, '{"text": "one"}\n{"text": "two"}\n',
          wrong_type='{"text": 8}\n{"text": ["eight"]}\n', huge_int=f'{{"text": "a", "id": {DIGITS}}}\n',
          deep='{"text": ' + "[" * DEEP + "]" * DEEP + "}\n"),
    Input("quiz.toml", lambda p, _: ["quiz", str(p)], 2, "", wrong_type='schema_version = "one"\nkind = 7\n',
          huge_int=f"schema_version = {DIGITS}\n", deep="a = " + "[" * DEEP + "]" * DEEP + "\n"),
]


def _make(kind: str, path: Path, spec: Input) -> None:
    """Make ``path`` the ``kind`` of hostile file."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink loop":
        path.symlink_to(path.with_name(path.name + ".loop"))
        path.with_name(path.name + ".loop").symlink_to(path)
    elif kind == "huge":
        with open(path, "wb") as f:  # sparse: no disk used; a reader that reads it all would read 2 GiB of zeros
            f.truncate(2 * 2**30)
    else:
        data = {"empty": b"",
                "binary": bytes(range(256)) * 16,
                "aliases": (BOMB + "model_name_or_path: *i\n" + spec.good).encode(),
                "deep nesting": spec.deep.encode(),
                "huge integers": spec.huge_int.encode(),
                "wrong types": spec.wrong_type.encode(),
                "non-UTF-8": (spec.good + "# caf\xe9 au lait\n").encode("latin-1")}[kind]
        path.write_bytes(data)


KINDS = ["fifo", "device", "directory", "symlink loop", "empty", "binary", "huge", "aliases", "deep nesting",
         "huge integers", "wrong types", "non-UTF-8"]


class _Hung(Exception):
    pass


def _alarm(signum, frame):
    raise _Hung("no answer in 10 s: the reader blocked (a FIFO opened?) or ran away")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", INPUTS, ids=[i.name for i in INPUTS])
def test_every_input_made_hostile_is_named_at_once_with_its_exit_code(spec, kind, tmp_path, capsys, tiny_model_dir):
    (tmp_path / "model").symlink_to(tiny_model_dir)
    path = tmp_path / spec.name
    _make(kind, path, spec)
    argv = spec.argv(path, tmp_path)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    tracemalloc.start()
    started = time.monotonic()
    try:
        code = main(argv)
    finally:
        took = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    said = capsys.readouterr()
    text = said.out + said.err
    assert code == spec.code_for(kind), text
    assert not (tmp_path / "runs").exists()  # nothing was started
    assert spec.name in text, text  # the message names the file
    assert "internal error" not in text.lower() and "Traceback" not in text, text
    assert took < SECONDS, f"{took:.1f} s"
    assert peak < PYTHON_BYTES, f"{peak / 2**20:.0f} MB of Python allocations"
