"""Issue 35, items 3, 4, 5 and 7: input beyond gpuaccept's bounds and output that cannot be written, each named with an
exit code of its own, through the real CLI (``tui.cli.main``, in-process; no model is run).

- 3: a spec or record nested deeper than ``core.bounds.MAX_TOML_DEPTH`` (or a string longer than ``MAX_TOML_STRING``)
  is refused by name: exit 2 for a spec, a schema finding (exit 5) for a record; ``verify DIR`` reports it in its row
  and goes on with the others;
- 4: a path-like setting (model, data, spec, runs folder, record) longer than a path may be is bad input (exit 2),
  naming the setting and the limit;
- 5: standard output that cannot be written (a full disk) is named, exit 74, not an internal error (exit 1, which
  ``diff`` also uses for "not comparable");
- 7: data that is a directory, a FIFO or a device is named for what it is (exit 2), the FIFO never opened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from core.bounds import MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_TOML_DEPTH, MAX_TOML_STRING, TomlBoundsError, loads_bounded
from core.data import load_documents
from core.errors import DataError
from tests.records import path_of
from tui.cli import EXIT_STDOUT_ERROR, main

#: a tiny Llama config.json: planned offline, in milliseconds
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512)
#: the issue's reproduction: an array nested 5,000 deep
DEEP = "a = " + "[" * 5000 + "]" * 5000 + "\n"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY), encoding="utf-8")
    return path


def _plan(config: Path, *extra: str) -> list[str]:
    """``gpuaccept plan`` of the tiny config on a planned 24 GiB device (no host reading, no model loaded)."""
    return ["plan", "--model", str(config), "--devices", "24GiB", *extra]


# ------------------------------------------------------------------------------- 3: nesting and string length
def test_the_bounded_parser_counts_brackets_outside_strings_and_comments_only():
    text = ('s = "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[ \\" [[[["  # [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n'
            "l = '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[['\n"
            'm = """\n[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[ ""\n"""""\n'
            "n = '''[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[['''\n"
            + "x = " + "[" * MAX_TOML_DEPTH + "]" * MAX_TOML_DEPTH + "\n")
    assert loads_bounded(text) == tomllib.loads(text)
    with pytest.raises(TomlBoundsError, match=rf"nested more than {MAX_TOML_DEPTH} deep \(at line 1, column 37\)"):
        loads_bounded("y = " + "[" * (MAX_TOML_DEPTH + 1) + "]" * (MAX_TOML_DEPTH + 1))
    # a table nested by dotted keys parses without recursion in tomllib, but is as deep for whatever walks it
    with pytest.raises(TomlBoundsError, match=rf"nested more than {MAX_TOML_DEPTH} deep \(at a\.a\.a"):
        loads_bounded(".".join(["a"] * 5000) + " = 1\n")
    with pytest.raises(TomlBoundsError, match=r"^model is a string of 1,048,577 characters; gpuaccept reads strings "
                                              r"of at most 1,048,576"):
        loads_bounded(f'model = "{"a" * (MAX_TOML_STRING + 1)}"\n')
    # a TOMLDecodeError too: every reader that reports a file that is not TOML reports this one
    assert issubclass(TomlBoundsError, tomllib.TOMLDecodeError)


@pytest.mark.parametrize("command", [["plan"], ["run", "--headless", "--runs-dir"]])
def test_a_spec_nested_5000_deep_is_bad_input_named_with_the_limit(command, tmp_path, capsys):
    spec = tmp_path / "deep.toml"
    spec.write_text(DEEP)
    runs = tmp_path / "runs"
    assert main([*command, str(runs), str(spec)] if command[0] == "run" else [*command, str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpuaccept: error: spec: {spec}: tables and arrays nested more than 32 deep (at line 1, "
                          "column 37); gpuaccept reads at most 32 levels: flatten the file")
    assert "internal error" not in err and not runs.exists()


def test_verify_names_a_record_nested_5000_deep_as_schema_invalid(tmp_path, capsys):
    record = tmp_path / "record.toml"
    record.write_text(DEEP)
    assert main(["verify", str(record)]) == 5
    out = capsys.readouterr().out
    assert "schema: beyond what gpuaccept reads: tables and arrays nested more than 32 deep (at line 1, column 37)" \
        in out
    assert out.rstrip().endswith("SCHEMA INVALID (exit 5)")
    # as deep by dotted keys, and a string longer than the limit: the same finding, naming where
    record.write_text(".".join(["a"] * 5000) + " = 1\n")
    assert main(["verify", str(record)]) == 5
    assert "nested more than 32 deep (at a.a.a" in capsys.readouterr().out
    record.write_text(f'tool = "gpuaccept"\nnote = "{"x" * (MAX_TOML_STRING + 1)}"\n')
    assert main(["verify", "--json", str(record)]) == 5
    found = json.loads(capsys.readouterr().out)
    assert found["schema_problems"] == ["beyond what gpuaccept reads: note is a string of 1,048,577 characters; "
                                        "gpuaccept reads strings of at most 1,048,576: shorten it"]


def test_verify_dir_reports_the_deep_record_in_its_row_and_goes_on_with_the_others(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "record.toml").write_text(DEEP)
    (tmp_path / "good").mkdir()
    shutil.copyfile(path_of("lora"), tmp_path / "good" / "record.toml")
    assert main(["verify", str(tmp_path)]) == 5  # the first of 4, 8, 5, 6, 3, 7 any record has
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["bad/record.toml", "good/record.toml"]
    assert lines[1].endswith("schema invalid") and lines[2].endswith("unsigned (consistent)")
    assert lines[-1] == "2 record(s); 0 verified (exit 5)"
    assert main(["verify", "--json", str(tmp_path)]) == 5
    table = json.loads(capsys.readouterr().out)
    assert [(Path(r["record"]).parent.name, r["exit_code"], r["result"]) for r in table["records"]] == [
        ("bad", 5, "schema invalid"), ("good", 3, "unsigned (consistent)")]


def test_diff_of_a_deep_record_is_one_that_cannot_be_read(tmp_path, capsys):
    record = tmp_path / "record.toml"
    record.write_text(DEEP)
    assert main(["diff", str(record), str(path_of("lora"))]) == 2
    assert "is not a TOML record (tables and arrays nested more than 32 deep" in capsys.readouterr().err


def test_sign_of_a_deep_record_is_refused_and_writes_nothing(tmp_path, capsys):
    import subprocess

    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    record = tmp_path / "record.toml"
    record.write_text(DEEP)
    assert main(["sign", str(record), "--key", str(key), "--operator", "ada",
                 "--decision", "reject"]) == 2
    assert "is not a gpuaccept record (not TOML: tables and arrays nested more than 32 deep" in capsys.readouterr().err
    assert record.read_text() == DEEP and not (tmp_path / "record.toml.sig").exists()


# ------------------------------------------------------------------------------------------ 4: long paths
def test_a_1mb_model_is_bad_input_naming_the_setting_and_its_limit(tmp_path, capsys):
    model = "a" * 1_000_000
    assert main(["plan", "--model", model, "--devices", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuaccept: error: model: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa… (1,000,000 characters) is "
                          "1,000,000 bytes long; a path may be at most 4,095 bytes (PATH_MAX): give a shorter path")
    assert len(err) < 300  # the megabyte is not repeated
    spec = tmp_path / "spec.toml"
    spec.write_text(f'model = "{model}"\n')
    assert main(["plan", str(spec), "--devices", "24GiB"]) == 2
    assert "model: aaaa" in capsys.readouterr().err
    # short enough as a whole, but one part longer than a file name may be
    assert main(["plan", "--model", f"models/{'b' * (MAX_NAME_BYTES + 1)}", "--devices", "24GiB"]) == 2
    assert f"is {MAX_NAME_BYTES + 1} bytes; each part of a path between slashes may be at most 255 bytes (NAME_MAX)" \
        in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "setting"), [
    (["plan", "--data", "d" * 5000 + ".txt"], "data"),
    (["plan", "s" * 5000 + ".toml"], "spec"),
    (["run", "--headless", "--runs-dir", "r" * 5000], "runs_dir"),
    (["verify", "v" * 5000], "record"),
    (["diff", "x" * 5000, str(path_of("lora"))], "record"),
])
def test_every_path_setting_longer_than_a_path_is_bad_input(argv, setting, config, capsys):
    if argv[0] == "plan":
        argv = [*argv, "--model", str(config), "--devices", "24GiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpuaccept: error: {setting}: ")
    assert f"a path may be at most {MAX_PATH_BYTES:,} bytes (PATH_MAX)" in err and "internal error" not in err


# ------------------------------------------------------------------------------- 5: standard output not written
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("command", ["plan", "plan --json", "verify", "verify DIR", "diff"])
def test_output_to_a_full_device_is_named_with_its_own_exit_code(command, config, monkeypatch, capsys, tmp_path):
    record = str(path_of("lora"))
    (tmp_path / "runs" / "one").mkdir(parents=True)
    shutil.copyfile(record, tmp_path / "runs" / "one" / "record.toml")
    argv = {"plan": _plan(config), "plan --json": _plan(config, "--json"), "verify": ["verify", record],
            "verify DIR": ["verify", str(tmp_path / "runs")], "diff": ["diff", record, record]}[command]
    with open("/dev/full", "w", encoding="utf-8") as full:
        monkeypatch.setattr(sys, "stdout", full)
        code = main(argv)
    assert code == EXIT_STDOUT_ERROR == 74
    assert capsys.readouterr().err == "gpuaccept: cannot write to standard output: No space left on device (exit 74)\n"


def test_a_command_whose_output_is_written_still_exits_with_its_verdict(capsys):
    record = str(path_of("lora"))
    assert main(["diff", record, record]) == 0 and main(["verify", record]) == 3
    assert "UNSIGNED (consistent) (exit 3)" in capsys.readouterr().out


# ------------------------------------------------------------------------------ 7: data that is not a file
@pytest.mark.parametrize(("make", "kind"), [
    (lambda p: p.mkdir(), "a directory"),
    (lambda p: os.mkfifo(p), "a FIFO (named pipe)"),
])
@pytest.mark.parametrize("name", ["data.txt", "data"])
def test_data_that_is_not_a_regular_file_is_named_for_what_it_is(make, kind, name, config, tmp_path, capsys):
    data = tmp_path / name
    make(data)
    assert main(_plan(config, "--data", str(data))) == 2  # a FIFO opened for reading would block here: never opened
    assert capsys.readouterr().err == (f"gpuaccept: error: data: {data} is {kind}, not a file; give 'embedded' or a "
                                       ".txt / .jsonl file\n")
    with pytest.raises(DataError, match=re.escape(f"is {kind}, not a file")):
        load_documents(str(data))  # the reader's own check, for a spec validated before the path changed


def test_a_device_given_as_data_is_named(config, capsys):
    assert main(_plan(config, "--data", os.devnull)) == 2
    assert f"data: {os.devnull} is a character device, not a file" in capsys.readouterr().err


# ---------------------------------------------------------------------- 4 and 7 in command mode (your own command)
@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--model", "m" * 5000, "command.model: mmmm"),
    ("--data", "d" * 5000 + ".txt", "command.data: dddd"),
    ("--workdir", "w" * 5000, "command.workdir: wwww"),
])
def test_your_own_commands_paths_are_bounded_too(flag, value, says, capsys):
    assert main(["run", "--headless", "--command", "python3 train.py --output_dir {out}", flag, value]) == 2
    err = capsys.readouterr().err
    assert says in err and "a path may be at most 4,095 bytes (PATH_MAX)" in err and "internal error" not in err


def test_your_own_commands_data_that_is_a_fifo_is_named(tmp_path, capsys):
    fifo = tmp_path / "data.txt"
    os.mkfifo(fifo)
    assert main(["run", "--headless", "--command", "python3 train.py --output_dir {out}", "--data", str(fifo)]) == 2
    assert f"command.data: {fifo} is a FIFO (named pipe), not a file" in capsys.readouterr().err


#: a "billion laughs" of nested YAML aliases: 858 bytes that expand to 9^9 strings (issue 52)
YAML_BOMB = "".join(f"{k}: &{k} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
                    for p, k in zip(["", *"abcdefgh"], "abcdefghi")) + "model_name_or_path: *i\n"


@pytest.mark.parametrize(("name", "text", "says"), [
    ("aliases", YAML_BOMB, "expands to more than 100,000 values (anchors and aliases counted"),
    ("deep flow", "a: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested more than 32 deep (at line 1, column 36)"),
    ("deep block", "".join(" " * i + f"k{i}:\n" for i in range(40)) + " " * 40 + "v: 1\n",
     "nested more than 32 deep"),
    ("huge integer", "per_device_train_batch_size: " + "9" * 5000 + "\n", "an integer of more than 4,300 digits"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 and "\n" not in v else "")
@pytest.mark.parametrize("command", [["plan"], ["run", "--headless", "--runs-dir"]], ids=["plan", "run"])
def test_a_hostile_trainer_yaml_is_bad_input_named_at_once(name, text, says, command, tmp_path, capsys):
    """Issue 52: an 858-byte YAML of nested aliases grew `plan` to 2.5 GB in 60 s (command mode to 15 GB); YAML nested
    50,000 deep and an integer of 5,000 digits were internal errors (exit 1). Each is named, exit 2, in well under 5 s,
    before anything is built from the file."""
    import time

    config = tmp_path / "config.yaml"
    config.write_text(text)
    runs = tmp_path / "runs"
    started = time.monotonic()
    code = main([*command, str(runs), str(config)] if command[0] == "run" else [*command, str(config)])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "internal error" not in err, err
    assert time.monotonic() - started < 5 and not runs.exists()


@pytest.mark.parametrize("value", ["eight", '"1e400"', ".nan", "2.9", "true", '"8"'])
def test_a_value_of_the_wrong_type_is_refused_never_coerced(value, tmp_path, capsys):
    """Issue 52: a batch size of "eight", "1e400" or .nan was an internal error (exit 1); 2.9 was planned as 2 and
    true as 1. Each is refused by name, exit 2."""
    config = tmp_path / "trl.yaml"
    config.write_text(f"model_name_or_path: smollm2-135m\nper_device_train_batch_size: {value}\nmax_length: 64\n")
    assert main(["plan", str(config), "--devices", "1xH100"]) == 2
    err = capsys.readouterr().err
    assert "trl:per_device_train_batch_size:" in err and "is not an integer" in err and "internal" not in err, err


def test_a_hundred_thousand_lora_targets_are_refused_at_once():
    """Issue 52: `[lora] targets` with 100,000 entries took minutes (a quadratic duplicate check)."""
    import time

    from core.errors import SpecError
    from core.spec import RunSpec

    started = time.monotonic()
    with pytest.raises(SpecError, match=r"100,000 modules named; .* \(give at most 1,000"):
        RunSpec.build(mode="lora", lora_targets=",".join(f"m{i}" for i in range(100_000)))
    with pytest.raises(SpecError, match=r"m0, m1, m10, .* and 490 more named twice"):
        RunSpec.build(mode="lora", lora_targets=",".join([f"m{i}" for i in range(500)] * 2))
    assert time.monotonic() - started < 2


def test_an_empty_command_is_refused_not_run_as_the_own_recipe(tmp_path, capsys):
    """Issue 52: `--command ""` silently ran the built-in 30-step recipe ("   " was refused)."""
    runs = tmp_path / "runs"
    assert main(["run", "--headless", "--runs-dir", str(runs), "--command", ""]) == 2
    assert "command.train: the training command is missing" in capsys.readouterr().err and not runs.exists()


def _specials(folder: Path, name: str) -> dict[str, Path]:
    """A FIFO and a link to /dev/zero named ``name`` (in two subfolders of ``folder``)."""
    made = {}
    for kind in ("fifo", "zero"):
        (folder / kind).mkdir(parents=True, exist_ok=True)
        path = folder / kind / name
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
        made[kind] = path
    return made


@pytest.mark.parametrize("name", ["spec.toml", "config.yaml"])
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_spec_that_is_a_fifo_or_dev_zero_is_named_never_opened(name, kind, tmp_path, capsys):
    """Issue 52: a spec that is a FIFO hung; a link to /dev/zero ended in MemoryError."""
    path = _specials(tmp_path, name)[kind]
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is {'a FIFO (named pipe)' if kind == 'fifo' else 'a character device'}, not a file" in err, err


def test_quiz_and_verify_of_a_fifo_name_it_and_verify_dir_gives_it_a_row(tmp_path, capsys):
    """Issue 52: `quiz` on a FIFO hung; `verify DIR` with a FIFO or a device named *.toml beside the records hung or
    aborted with an internal error. Each is named; in a folder each is a row of its own and the others are verified."""
    made = _specials(tmp_path / "runs", "x.toml")
    good = tmp_path / "runs" / "run1" / "record.toml"
    good.parent.mkdir(parents=True)
    shutil.copyfile(path_of("lora"), good)
    assert main(["quiz", str(made["fifo"])]) == 2
    assert "is a FIFO (named pipe), not a file" in capsys.readouterr().err
    assert main(["verify", str(made["zero"])]) == 5
    assert "is a character device, not a record file" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "runs"), "--json"]) == 5
    rows = {Path(r["record"]).parent.name: r for r in json.loads(capsys.readouterr().out)["records"]}
    assert set(rows) == {"fifo", "zero", "run1"} and rows["run1"]["exit_code"] == 3
    assert rows["fifo"]["exit_code"] == rows["zero"]["exit_code"] == 5


def test_a_huge_signature_is_bad_without_running_ssh_keygen_over_it(tmp_path, capsys):
    """Issue 52: a 50 MB .sig ran into ssh-keygen's 60 s timeout, which escaped as an internal error."""
    record = tmp_path / "record.toml"
    shutil.copyfile(path_of("lora"), record)
    with open(tmp_path / "record.toml.sig", "wb") as f:
        f.truncate(50 * 2**20)
    assert main(["verify", str(record)]) == 4
    assert "record.toml.sig is 52,428,800 bytes; an SSH signature is under 16,384" in capsys.readouterr().out


def test_a_signal_while_the_plan_is_traced_starts_no_later_stage(tiny_model_dir, tmp_path):
    """Issue 52: SIGTERM during the traced plan still marked the plan pass and started the probe 12 s later. The
    headless run's stop flag (set by the signal handler) ends the run after the plan: the probe never starts, the
    record says it was cancelled and why."""
    import tomllib

    from core.events import StageStarted
    from core.pipeline import run_pipeline
    from core.spec import RunSpec

    spec = RunSpec.build(mode="lora", model=str(tiny_model_dir), seq_len=32, devices="cpu")
    events, gen = [], run_pipeline(spec, tmp_path / "runs", cancelled=lambda: True)
    try:
        while True:
            events.append(next(gen))
    except StopIteration as done:
        path = done.value
    assert [e.stage for e in events if isinstance(e, StageStarted)] == ["plan", "record"]  # no probe
    stage = tomllib.loads(path.read_text())["verdict"]["stages"]["probe"]
    assert stage["status"] == "cancelled" and "while the plan was made" in stage["evidence"]
    from core.record.verify import verify

    assert verify(path).exit_code == 3  # consistent, unsigned


def _slow_ssh_keygen(folder: Path) -> Path:
    """A stand-in ssh-keygen on PATH that writes its pid beside itself and sleeps."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "ssh-keygen"
    exe.write_text(f"#!/bin/sh\necho $$ > {folder}/pid\nexec sleep 30\n")
    exe.chmod(0o755)
    return exe


def test_an_ssh_keygen_that_does_not_answer_is_named_and_stopped(tmp_path, monkeypatch, capsys):
    """Issue 52: ssh-keygen's timeout escaped as an internal error."""
    from core.record import signing

    _slow_ssh_keygen(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(signing, "SSH_KEYGEN_TIMEOUT_S", 0.5)
    record = tmp_path / "record.toml"
    shutil.copyfile(path_of("lora"), record)
    (tmp_path / "record.toml.sig").write_text("-----BEGIN SSH SIGNATURE-----\n")
    assert main(["verify", str(record)]) == 4
    assert "ssh-keygen did not finish in 0 s" in capsys.readouterr().out
    pid = int((tmp_path / "bin" / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()



def test_a_record_with_a_check_named_twice_or_past_any_size_is_refused_at_once(tmp_path, capsys):
    """Issue 52: an 80 MB record with every check duplicated 20,000 times took 271 s and was called consistent. A
    row named twice is a schema problem (exit 5); 20,000 copies are found in one pass."""
    import time

    import tomli_w

    rec = tomllib.loads(path_of("lora").read_text())
    rec["resume"]["checks"] = rec["resume"]["checks"] * 100  # 2,100 rows
    record = tmp_path / "record.toml"
    record.write_text(tomli_w.dumps(rec))
    started = time.monotonic()
    assert main(["verify", str(record)]) == 5
    assert "resume.checks names name kill more than once" in capsys.readouterr().out
    assert time.monotonic() - started < 5
    with open(record, "ab") as f:  # past any record's size (80 MB in the attack): refused before it is parsed
        f.truncate(40 * 2**20)
    started = time.monotonic()
    assert main(["verify", str(record)]) == 5
    assert "is 41,943,040 bytes, larger than 33,554,432: not a gpuaccept record" in capsys.readouterr().out
    assert time.monotonic() - started < 5
