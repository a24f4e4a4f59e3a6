"""The ``gpuaccept`` console script.

- ``gpuaccept run [SPEC.toml] --headless [flags]``: the whole pipeline, one line per event; exit 0 only when every stage
  passes; prints where the record is.
- ``gpuaccept monitor [--once [--json]] [--interval S] [--record FILE]``: every device's memory (NVML, mapped to CUDA
  devices by UUID; host memory in CPU mode), live or one sample.
- ``gpuaccept plan [SPEC.toml] [flags] [--json] [--traced] [--max-batch] [--max-seq]``: the memory plan only (no
  weights loaded), per device and per phase of the step, by ``--strategy`` (and ``--tp``); ``--devices 8x80GiB`` or
  ``24GiB,8GiB`` plans for a box you do not have, offline; ``--traced`` adds one step traced on fake tensors
  (core/plan/traced.py) beside it, the most different line named; ``--max-batch`` / ``--max-seq`` search the largest
  micro-batch / sequence length that fits each device. Exit 0 when every device fits, 3 when one does not, 4 when
  none fails but a capacity is unknown.

torch and transformers are imported only when a command needs them. Bad input prints one named error line (exit 2),
never a traceback; standard output that cannot be written (a full disk) one line too, exit 74 (EX_IOERR).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tui.flags import (
    SPEC_KEYS,
    build_parser,
    command_criteria_from_args,
    command_mode,
    command_spec_from_args,
    complete_files,
    imported_config,
    spec_from_args,
    unknown_arguments,
)
from tui.plantext import format_largest, format_plan, format_traced

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
#: ``gpuaccept plan``: a device does not fit; no device fails, but one's capacity is unknown.
EXIT_DOES_NOT_FIT, EXIT_FIT_UNKNOWN = 3, 4
#: The reader of stdout closed the pipe: 128 + SIGPIPE, as a shell reports a tool that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141
#: Standard output cannot be written (a full disk, an I/O error): EX_IOERR of sysexits.h, distinct from every verdict
#: code (0-8), from 2 (bad input) and from 128 + n (a signal).
EXIT_STDOUT_ERROR = 74


class StdoutWriteError(OSError):
    """Writing or flushing standard output failed (``errno`` and ``strerror`` are the write's): not a failure of the
    command itself, so :func:`main` names it and exits :data:`EXIT_STDOUT_ERROR`."""


class _CheckedStdout:
    """``sys.stdout`` while a command runs: a write or flush that fails with an ``OSError`` (``ENOSPC`` on a full
    disk, ``EIO``) raises :class:`StdoutWriteError` instead, so that it is told from an ``OSError`` of the command's own
    files; a closed pipe (``BrokenPipeError``) is left as it is (exit 141). Everything else is the stream's."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutWriteError(exc.errno, exc.strerror or str(exc)) from exc

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutWriteError(exc.errno, exc.strerror or str(exc)) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["run"]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        unknown_arguments(parser, getattr(args, "command", None), unknown)  # exits 2, as argparse does
    from core.errors import GpuAcceptError

    stdout = sys.stdout
    if not _draws_a_screen(args):  # a Textual screen owns the terminal: its app redirects stdout itself
        sys.stdout = _CheckedStdout(stdout)
    try:
        code = _command(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is caught below
        return code
    except StdoutWriteError as exc:  # `gpuaccept plan > /dev/full`: named, not an internal error, not a verdict
        _silence(stdout)  # what is left in its buffer is dropped at exit, not written (nor failed on) again
        try:
            print(f"gpuaccept: cannot write to standard output: {exc.strerror} (exit {EXIT_STDOUT_ERROR})",
                  file=sys.stderr)
        except OSError:
            pass
        return EXIT_STDOUT_ERROR
    except GpuAcceptError as exc:
        print(f"gpuaccept: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gpuaccept: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`gpuaccept plan --json | head`): end quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback on request
        if os.environ.get("GPUACCEPT_DEBUG"):
            raise
        print(f"gpuaccept: internal error: {type(exc).__name__}: {exc} (GPUACCEPT_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_FAIL
    finally:
        if isinstance(sys.stdout, _CheckedStdout):
            sys.stdout = stdout


def _draws_a_screen(args: argparse.Namespace) -> bool:
    """The command runs a Textual app (the wizard, the quiz, the live monitor) rather than printing to stdout."""
    return (args.command == "run" and not args.headless) or args.command == "quiz" or \
        (args.command == "monitor" and not args.once)


def _silence(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (when it has one), so that the interpreter's flush of it at
    exit neither writes nor fails again (a failed flush at exit would make the exit status 120)."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _command(args: argparse.Namespace) -> int:
    """Run the subcommand ``args`` names; its exit code (the parser's help, exit 2, without one)."""
    if args.command == "plan":
        return cmd_plan(args)
    if args.command == "monitor":
        if args.json and not args.once:
            print("gpuaccept: error: --json goes with --once (the live view is the bars)", file=sys.stderr)
            return EXIT_USAGE
        if args.interval <= 0:
            print("gpuaccept: error: --interval must be a positive number of seconds", file=sys.stderr)
            return EXIT_USAGE
        from tui.monitor import main as monitor_main

        return monitor_main(args)
    if args.command == "run":
        from core.api import check_path

        check_path("runs_dir", args.runs_dir)  # a name the file system refuses is named here, with its limit
        if args.json and not args.headless:
            print("gpuaccept: error: --json goes with --headless (the wizard is the other way to run)",
                  file=sys.stderr)
            return EXIT_USAGE
        if command_mode(args):
            return cmd_run_command(args) if args.headless else cmd_wizard(args)
        return cmd_run(args) if args.headless else cmd_wizard(args)
    if args.command == "sign":
        return cmd_sign(args)
    if args.command == "verify":
        return cmd_verify(args)
    if args.command == "diff":
        return cmd_diff(args)
    if args.command == "quiz":
        return cmd_quiz(args)
    if args.command == "completion":  # shtab is imported here only (a GPU box running the tree may not have it)
        import shtab

        parser = build_parser()
        complete_files(parser)
        script = shtab.complete(parser, shell=args.shell)
        print(script.rstrip("\n"))  # one final newline: a file redirected to ends as a text file ends
        return EXIT_OK
    build_parser().print_help()
    return EXIT_USAGE


def cmd_quiz(args: argparse.Namespace) -> int:
    """The onboarding quiz over one record (keyboard only); its questions are checked before any screen opens."""
    from core.api import build_quiz, check_path, read_record
    from core.errors import GpuAcceptError

    check_path("record", args.record)
    path = Path(args.record)
    try:
        record = read_record(path)  # nesting and strings bounded (core/bounds.py)
    except (OSError, ValueError) as exc:  # ValueError: not TOML, not UTF-8, beyond the bounds
        raise GpuAcceptError(f"{path}: cannot read the record ({exc}); give the record.toml of a run") from None
    if record.get("kind") == "command":
        raise GpuAcceptError(f"{path} is the record of your own command (kind = \"command\"): the quiz's questions are "
                             "built from gpuaccept's own recipe runs (a plan of every component, the probe's ledger); "
                             "take it on the record of a run of gpuaccept's recipe")
    try:
        build_quiz(record)
    except (OSError, ValueError) as exc:
        raise GpuAcceptError(f"{path}: cannot read the record ({exc}); give the record.toml of a run") from None
    except GpuAcceptError as exc:  # a record without what the questions are built from: say which file
        raise GpuAcceptError(f"{path}: {exc}") from None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):  # piped answers drew a full screen that took stray keys
        raise GpuAcceptError("quiz: the quiz is answered with the keyboard at a terminal, and stdin or stdout is not "
                             "one here (a pipe or a file): run gpuaccept quiz in a terminal (over ssh: ssh -t)")
    from tui.screens.quiz import QuizApp

    return QuizApp(path, args.operator).run() or 0


def _several_nodes_headless(field: str, nnodes: int) -> int:
    """The wizard refuses a run on several nodes: the nodes agree between stages in the headless run only
    (core/cluster/agree.py). Prints the error; returns :data:`EXIT_USAGE`."""
    print(f"gpuaccept: error: {field}: a run on {nnodes} nodes is headless: its nodes stop together and share their "
          "records there, not in the wizard; run `gpuaccept run --headless ...` with the same flags on every node",
          file=sys.stderr)
    return EXIT_USAGE


def cmd_wizard(args: argparse.Namespace) -> int:
    """The Textual wizard, prefilled with the spec file and flags given."""
    from tui.app import GpuAcceptApp

    if command_mode(args):  # prefilled from the flags and the [command] table; validated on the form
        command = command_spec_from_args(args)  # a bad flag is one line, before any screen
        if command.nnodes > 1:
            return _several_nodes_headless("command.nnodes", command.nnodes)
        app = GpuAcceptApp(runs_root=Path(args.runs_dir), mode="command",
                           command_fields=command.to_dict()["command"])
        app.state.command_criteria = command_criteria_from_args(args)
        code = app.run()
        if app.state.record_path is not None:
            print(f"record: {app.state.record_path}")
        return int(code or 0)
    spec = spec_from_args(args)  # validates flags first: a bad flag is one line, before any screen
    if spec.torchrun.nnodes > 1:
        return _several_nodes_headless("torchrun.nnodes", spec.torchrun.nnodes)
    fields = {k: getattr(args, k) for k in SPEC_KEYS if getattr(args, k, None) is not None and k != "mode"}
    if args.spec:  # what the file sets, in its tables and [accept] too: each value not the mode's default (the form's)
        from tui.screens.setup import fields_of

        fields = {**fields_of(spec), **fields}
    app = GpuAcceptApp(runs_root=Path(args.runs_dir), fields=fields, mode=spec.mode)
    imported = imported_config(args)
    app.state.imported_note = imported.summary()[0] if imported is not None else ""
    app.state.imported_lines = imported.summary() if imported is not None else []
    code = app.run()
    if app.state.record_path is not None:
        print(f"record: {app.state.record_path}")
    return int(code or 0)


def cmd_plan(args: argparse.Namespace) -> int:
    """Exit codes: 0 every device fits, 3 a device does not fit, 4 none fails but a device's capacity is unknown, 2 bad
    input. Fit is judged by the larger of the analytic and traced peaks (with --traced). What is printed is
    :func:`core.api.plan_report`'s (the Plan screen's too)."""
    from core.api import plan_report

    if command_mode(args):
        from core.errors import SpecError

        raise SpecError("command", f"{args.spec} holds a [command] table: a command is planned from what it ran "
                                   f"(its Trainer's model, batch and optimizer), so run it: gpuaccept run {args.spec} "
                                   "--headless; gpuaccept plan takes gpuaccept's own recipe settings")
    spec = spec_from_args(args)
    imported = imported_config(args)
    report = plan_report(spec, traced=args.traced, max_batch=args.max_batch, max_seq=args.max_seq)
    if args.json:
        out = report.to_json()
        if imported is not None:
            out["imported"] = {"format": imported.format, "path": imported.path, "sha256": imported.sha256,
                               "used": imported.used, "ignored": imported.ignored}
        print(json.dumps(out, indent=2))
    else:
        if imported is not None:
            print("\n".join(imported.summary()) + "\n")
        print(format_plan(report.plan, spec, report.fits))
        if report.traced is not None:
            print("\n" + format_traced(report.traced))
        for rows in report.largest.values():
            print("\n" + format_largest(rows, spec, report.ctx.devices))
    if not report.all_fit:
        return EXIT_DOES_NOT_FIT
    return EXIT_FIT_UNKNOWN if report.fit_unknown else EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    """Add the sign-off (when the record has none) and sign the record's bytes; prints the key's fingerprint.
    Nothing is changed unless the key can sign and the record (with its sign-off) verifies. An accept of a record
    whose verdict is not pass is refused (exit 2) without ``--override "reason"``
    (:func:`core.record.signoff.checked_signoff`)."""
    from core.api import fingerprint, make_signoff, sign_record

    if args.operator is not None and not args.operator.strip():
        print("gpuaccept: error: --operator is empty: give the name of who signs off", file=sys.stderr)
        return EXIT_USAGE
    if bool(args.operator) != bool(args.decision):
        print("gpuaccept: error: --operator and --decision go together", file=sys.stderr)
        return EXIT_USAGE
    if args.override is not None and not args.operator:
        print("gpuaccept: error: --override goes with --operator and --decision accept (a record written without a "
              "sign-off)", file=sys.stderr)
        return EXIT_USAGE
    signoff = None
    if args.operator:
        try:
            signoff = make_signoff(args.operator, args.decision, args.role, args.comment, args.override)
        except ValueError as exc:
            print(f"gpuaccept: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    fp = fingerprint(Path(args.key))
    sig = sign_record(Path(args.record), Path(args.key), signoff)
    print(f"signed {Path(args.record).resolve()} with {fp}\nsignature: {sig}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Exit codes: 0 verified and signed by an allowed signer, 7 the same with the signer not checked, 8 the signature
    intact but the identity not allowed, 3 consistent but unsigned, 4 bad signature, 5 schema, 6 verdict, 2 usage
    (docs/record.md). SIGTERM ends it through Python (SystemExit, exit 143), so the ssh-keygen it runs is stopped with
    it (core.record.signing), never left running."""
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        return _cmd_verify(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cmd_verify(args: argparse.Namespace) -> int:
    from core.api import check_path, verification_summary, verify

    if bool(args.allowed_signers) != bool(args.identity):
        print("gpuaccept: error: --allowed-signers and --identity go together", file=sys.stderr)
        return EXIT_USAGE
    signers = Path(args.allowed_signers) if args.allowed_signers else None
    check_path("record", args.record)  # before any stat: a path too long for the file system is bad input (exit 2)
    notes: list[str] = []
    if args.deep and not (Path(args.record) / "record.toml").is_file():
        print(f"gpuaccept: error: --deep reads a run directory: {args.record} holds no record.toml (give the folder "
              "the run wrote, with its checkpoints)", file=sys.stderr)
        return EXIT_USAGE
    if Path(args.record).is_dir() and not args.deep:
        return _verify_folder(Path(args.record), signers, args.identity, args.json)
    try:
        if args.deep:
            from core.api import verify_deep

            result, notes = verify_deep(Path(args.record), signers, args.identity)
            args.record = str(Path(args.record) / "record.toml")
        else:
            result = verify(Path(args.record), signers, args.identity)
    except FileNotFoundError as exc:
        print(f"gpuaccept: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    code = result.exit_code
    if args.json:
        print(json.dumps(verification_summary(Path(args.record), result), indent=2))
        return code
    print("\n".join(result.lines() + notes))
    print({0: "VERIFIED", 3: "UNSIGNED (consistent)", 4: "BAD SIGNATURE", 5: "SCHEMA INVALID",
           6: "VERDICT DOES NOT FOLLOW FROM THE DATA",
           7: "SIGNATURE GOOD, SIGNER NOT CHECKED (give --allowed-signers and --identity)",
           8: "SIGNATURE INTACT, SIGNER NOT ALLOWED (this identity may not sign with that key)"}[code]
          + f" (exit {code})")
    return code


def _verify_folder(folder: Path, signers: Path | None, identity: str | None, as_json: bool) -> int:
    """``gpuaccept verify DIR``: every record.toml below ``folder``, a line each (record, box, verdict, signature,
    what verify found); the exit code is the first of 4, 8, 5, 6, 3, 7, 0 any record has (2: no record)."""
    from core.api import folder_exit_code, folder_summary, format_folder, verify_folder

    rows = verify_folder(folder, signers, identity)
    code = folder_exit_code(rows)
    if as_json:
        print(json.dumps(folder_summary(folder, rows), indent=2))
        return code
    print(format_folder(rows, folder))
    if rows:
        print(f"{len(rows)} record(s); {sum(r['exit_code'] == 0 for r in rows)} verified (exit {code})")
    else:
        print(f"gpuaccept: error: no record.toml below {folder}", file=sys.stderr)
    return code


def cmd_diff(args: argparse.Namespace) -> int:
    """``gpuaccept diff RECORD...``: exit 0 when the records are comparable (the same spec), 1 when they are shown
    but not comparable, 2 on a record that cannot be read."""
    from core.api import check_path, diff, format_comparison

    for record in args.records:
        check_path("record", record)  # a path too long for the file system: one that cannot be read (exit 2)
    try:
        comparison = diff([Path(p) for p in args.records])
    except (FileNotFoundError, ValueError) as exc:
        print(f"gpuaccept: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(comparison.to_json(), indent=2))
    else:
        print(format_comparison(comparison, everything=args.all))
    return EXIT_OK if comparison.comparable else EXIT_FAIL


def cmd_run(args: argparse.Namespace) -> int:
    from core.api import run
    from core.devicespec import parse_devices

    spec = spec_from_args(args)
    parse_devices(spec.devices)  # a planned box (8x80GiB) is refused here, before anything is loaded
    imported = imported_config(args)
    if imported is not None:
        print("\n".join(imported.summary()), flush=True, file=sys.stderr if args.json else sys.stdout)
    print(f"gpuaccept: {spec.mode} on {spec.model} ({spec.dtype}, micro-batch {spec.batch_size} x {spec.seq_len}, "
          f"{spec.steps} steps)", flush=True, file=sys.stderr if args.json else sys.stdout)
    stop = _stop_on_signals()  # SIGINT, SIGTERM, SIGHUP: the running stage is cancelled and the record written
    return _stopped_before_a_run_folder(stop, lambda: _print_run(
        run(spec, runs_root=Path(args.runs_dir), cancelled=lambda: stop["signal"] is not None), stop, args.json))


def cmd_run_command(args: argparse.Namespace) -> int:
    """Command mode, headless: the user's command run, measured, evaluated, killed and resumed; one line per event."""
    from core.api import run_command

    spec = command_spec_from_args(args)
    criteria = command_criteria_from_args(args)
    print(f"gpuaccept: your command, in {spec.workdir_path}: {spec.train}", flush=True,
          file=sys.stderr if args.json else sys.stdout)
    stop = _stop_on_signals()
    return _stopped_before_a_run_folder(stop, lambda: _print_run(
        run_command(spec, runs_root=Path(args.runs_dir), cancelled=lambda: stop["signal"] is not None,
                    criteria=criteria), stop, args.json))


def _stopped_before_a_run_folder(stop: dict[str, int | None], go: Any) -> int:
    """``go()``, a headless run; a signal that stopped it before its run folder was made (the data read, the plan:
    :mod:`core.interrupt`) is said as such, with exit 128 + its number, not as bad input."""
    from core.errors import StageCancelled

    try:
        return int(go())
    except StageCancelled as exc:
        if stop["signal"] is None:
            raise
        print(f"gpuaccept: {exc}; nothing was written", file=sys.stderr, flush=True)
        return 128 + stop["signal"]


#: headless: a wait's line again (its blocks, its seconds) at most this often while its phase lasts
WAIT_LINE_EVERY_S = 10.0


def _print_run(events: Any, stop: dict[str, int | None], as_json: bool = False) -> int:
    """Print a pipeline's events one line each (on stderr with ``as_json``, and then the run's summary as one JSON
    object on stdout: :func:`core.record.summary.run_summary`); the exit code: 0 when every stage passed, 1 when one
    failed, 128 + the signal's number when a signal stopped it."""
    from core.events import Message, Progress, RunFinished, StageFinished, StageStarted, Waiting

    out = sys.stderr if as_json else sys.stdout
    final: RunFinished | None = None
    said: tuple[str, float] = ("", 0.0)  # the last wait printed: its phase and when
    for event in events:
        if isinstance(event, Waiting):  # a new phase at once; the same phase's count at most every 10 s
            now = time.time()
            phase = f"{event.run}: {event.what.split(':')[0]}"
            if phase != said[0] or now - said[1] >= WAIT_LINE_EVERY_S:
                print(f"  {event.line(now)}", flush=True, file=out)
                said = (phase, now)
        elif isinstance(event, StageStarted):
            print(f"[{event.stage}] {event.detail}", flush=True, file=out)
        elif isinstance(event, StageFinished):
            print(f"[{event.stage}] {event.status}: {event.summary}", flush=True, file=out)
        elif isinstance(event, Progress):
            extra = f" loss {event.loss:.4f}" if event.loss is not None else ""
            print(f"  {event.run} step {event.step}/{event.total or '?'}{extra}", flush=True, file=out)
        elif isinstance(event, Message):
            print(f"  {event.text}", flush=True, file=out)
        elif isinstance(event, RunFinished):
            final = event
    assert final is not None
    for line in _judged_after(final):
        print(line, flush=True, file=out)
    print(f"verdict: {final.status}\nrecord: {final.record_path or '(not written: see above)'}", flush=True, file=out)
    if as_json:
        _print_run_json(final)
    if stop["signal"] is not None:
        print(f"gpuaccept: stopped by {signal.Signals(stop['signal']).name}; what was measured is in the record "
              "(unsigned)", file=sys.stderr, flush=True)
        return 128 + stop["signal"]
    return EXIT_OK if final.status == "pass" else EXIT_FAIL


def _judged_after(final: Any) -> list[str]:
    """The plan's criteria judged once the probe measured (``max_plan_error_pct``): its final status, with the rows
    missed, when the record's differs from the pass printed when the plan ran."""
    import tomllib

    from core.api import read_record

    path = Path(final.record_path) if final.record_path else None
    try:
        stage = read_record(path)["verdict"]["stages"]["plan"] if path else {}
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return []
    rows = [r for r in stage.get("criteria", []) if isinstance(r, dict) and r.get("met") is False]
    if not rows:
        return []
    words = "; ".join(f"{r.get('criterion')} {r.get('threshold')} on {r.get('on')}: {r.get('value', r.get('why'))}"
                      for r in rows)
    return [f"[plan] {stage.get('status')}: judged after the probe by {words}: MISSED"]


def _print_run_json(final: Any) -> None:
    """The run's summary object on stdout, from its record (what was written; a run without one says so)."""
    from core.api import read_record, run_summary

    path = Path(final.record_path) if final.record_path else None
    rec = read_record(path) if path is not None and path.is_file() else None
    print(json.dumps(run_summary(rec, path, final.status), indent=2), flush=True)


def _stop_on_signals() -> dict[str, int | None]:
    """Turn SIGINT, SIGTERM and SIGHUP into a cancel of the running stage (its child's process group is killed, the
    stage marked cancelled, the record written, unsigned), as the wizard's quit does; a second signal ends gpuaccept
    at once (the children still end themselves when gpuaccept is gone)."""
    stop: dict[str, int | None] = {"signal": None}

    from core.api import interrupt

    def handler(signum: int, frame: Any) -> None:
        if stop["signal"] is not None:
            raise KeyboardInterrupt
        stop["signal"] = signum
        interrupt(signum)  # inside the parent's own computation (the data read, the plan): StageCancelled at once

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    return stop
