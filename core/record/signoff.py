"""The sign-off: who accepts or rejects a record, put into it, checked, then signed.

The order is one function, :func:`sign_record`: the key must be able to sign, the record must conform to its schema and
every verdict must follow from its data (:func:`core.record.verify.record_problems`), then the sign-off is written
into the record (atomically) and its bytes are signed (:func:`core.record.signing.sign`). Nothing is changed unless
all of it can be done.

One rule for every sign-off, wherever it is written (``gpuaccept sign``, the wizard's sign-off screen through
``write_record``): :func:`checked_signoff`. An accept of a record whose verdict is not pass (a stage fail, error,
cancelled or not_run) is refused unless the operator gives the reason (``override``); the reason and the stages it
accepted although they did not pass (``overridden``) are kept in the sign-off, and ``verify`` and ``diff`` show them.

This module is the top of the record package's layers (pyproject.toml, ``[[tool.importlinter.contracts]]``): it
imports :mod:`core.record.verify`, :mod:`core.record.build` and :mod:`core.record.signing`; none of them imports it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from core.bounds import loads_bounded
from core.record.shape import stages_not_passed, verdict_passes
from core.record.signing import SigningError, can_sign, sign, signature_path
from core.record.verify import record_problems
from core.record.written import utc_now, write_record


class SignoffRefused(SigningError):
    """A sign-off that contradicts its record's verdict: an accept of a record that did not pass, without the
    operator's reason (``--override "reason"``), or an override where there is nothing to override. The message names
    the stages that did not pass and what to do; nothing is written."""


def make_signoff(operator: str, decision: str, role: str = "", comment: str = "",
                 override: str | None = None) -> dict[str, Any]:
    """A ``signoff`` table: who decided what, in which role, why, when (UTC), and with ``override`` the operator's
    reason to accept a record whose verdict is not pass (checked against the verdict by :func:`checked_signoff`).

    Raises:
        ValueError: an empty operator, a decision other than accept / reject, an override that is empty or goes with
            a reject (a reject needs no override).
    """
    if not operator.strip():
        raise ValueError("name the operator who signs off")
    if decision not in ("accept", "reject"):
        raise ValueError(f"the decision is accept or reject (got {decision!r})")
    signoff: dict[str, Any] = {"operator": operator.strip(), "role": role.strip(), "decision": decision,
                               "comment": comment.strip(), "time_utc": utc_now()}
    if override is not None:
        if not override.strip():
            raise ValueError("--override is empty: say why the record is accepted although its verdict is not pass")
        if decision != "accept":
            raise ValueError("--override goes with --decision accept: a reject of a record that did not pass needs "
                             "no override")
        signoff["override"] = override.strip()
    return signoff


def verdict_in_words(verdict: Any) -> str:
    """A verdict table in a few words for a message: ``FAIL (evaluation fail, resume cancelled)``, or ``PASS``."""
    stages = verdict.get("stages") if isinstance(verdict, dict) else None
    status = str(verdict.get("status", "?")) if isinstance(verdict, dict) else "?"

    def said(name: str) -> str:
        item = stages.get(name) if isinstance(stages, dict) else None
        return f"{name} {item.get('status', 'missing') if isinstance(item, dict) else 'missing'}"

    failing = [said(name) for name in stages_not_passed(verdict)]
    return status.upper() + (f" ({', '.join(failing)})" if failing else "")


def needs_override(verdict: Any, decision: str) -> bool:
    """Whether a sign-off with ``decision`` on a record with this ``verdict`` table needs the operator's reason: an
    accept of a verdict that is not pass (:func:`core.record.shape.verdict_passes`)."""
    return decision == "accept" and not verdict_passes(verdict)


def checked_signoff(verdict: Any, signoff: dict[str, Any]) -> dict[str, Any]:
    """The sign-off as it may be written into a record whose verdict table is ``verdict``: the one rule of a sign-off
    against its verdict, applied by :func:`sign_record` and by the runs' ``write_record`` (the wizard).

    An accept of a verdict that is not pass needs ``override`` (the operator's reason); the sign-off returned then
    holds ``overridden``, the stages that did not pass (:func:`core.record.shape.stages_not_passed`). A reject needs
    no override; an unsigned table (``status = "unsigned"``) is returned as it is.

    Raises:
        SignoffRefused: an accept of a verdict that is not pass without an override (the message names the stages and
            ``--override "reason"``), or an override of a verdict that passed or with a reject.
    """
    if signoff.get("status") == "unsigned":
        return signoff
    reason = signoff.get("override")
    if needs_override(verdict, str(signoff.get("decision"))):
        if not isinstance(reason, str) or not reason.strip():
            raise SignoffRefused(
                f"refused: the decision is accept, but the verdict is {verdict_in_words(verdict)}; accepting a record "
                "that did not pass needs the operator's reason: --override \"reason\" signs it anyway (the reason is "
                "kept in the record's sign-off and shown by verify and diff), or give --decision reject")
        return {**signoff, "override": reason.strip(), "overridden": stages_not_passed(verdict)}
    if "override" in signoff or "overridden" in signoff:
        if signoff.get("decision") != "accept":
            raise SignoffRefused("refused: --override goes with --decision accept; a reject needs no override")
        raise SignoffRefused("refused: the verdict is PASS, there is nothing to override; sign without --override")
    return signoff


def add_signoff(path: Path, signoff: dict[str, Any]) -> dict[str, Any]:
    """Put ``signoff`` into the unsigned record at ``path`` and rewrite it atomically; returns the record.

    Raises:
        ValueError: the record already holds a sign-off, or is already signed (``record.toml.sig`` exists).
    """
    path = Path(path)
    if signature_path(path).exists():
        raise ValueError(f"{path} is already signed; a signed record is never rewritten")
    record = loads_bounded(path.read_text(encoding="utf-8"))
    current = record.get("signoff", {})
    if current.get("status") != "unsigned":
        raise ValueError(f"{path} already holds a sign-off by {current.get('operator')!r} "
                         f"({current.get('decision')}); sign it as it is, without --operator")
    record["signoff"] = signoff
    write_record(record, path)
    return record


def sign_record(record: Path, key: Path, signoff: dict[str, Any] | None = None) -> Path:
    """Sign off and sign a record: nothing is changed unless all of it can be done.

    Order: the record must parse, and with ``signoff`` put in (when given) conform to the schema and have every
    verdict follow from its data (:func:`core.record.verify.record_problems`); the sign-off must not contradict the
    verdict (:func:`checked_signoff`: an accept of a verdict that is not pass holds the operator's ``override``); the
    key must sign a scratch file (:func:`core.record.signing.can_sign`); then the sign-off is written into the record
    (atomically) and its bytes signed. A symlink is followed.

    Returns:
        the path of the signature, ``record.toml.sig``.

    Raises:
        SignoffRefused: an accept of a record that did not pass without the operator's reason (or an override where
            there is nothing to override); the record is untouched.
        SigningError: anything else that stopped it, with what to do; the record is untouched.
    """
    record = Path(record).resolve()
    if not record.is_file():
        raise SigningError(f"record {record} not found")
    if signature_path(record).exists():
        raise SigningError(f"{signature_path(record)} already exists: a signed record is not signed again")
    try:
        data = loads_bounded(record.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SigningError(f"{record} is not a gpuaccept record (not TOML: {exc})") from None
    current = data.get("signoff", {})
    if signoff is None and current.get("status") == "unsigned":
        raise SigningError("the record has no sign-off: give --operator NAME --decision accept|reject")
    refused: SignoffRefused | None = None  # said after the record's own findings: a record must verify first
    if signoff is not None:
        if current.get("status") != "unsigned":
            raise SigningError(f"the record already holds a sign-off by {current.get('operator')!r} "
                               f"({current.get('decision')}); sign it as it is, without --operator")
        try:
            signoff = checked_signoff(data.get("verdict"), signoff)
            data["signoff"] = signoff
        except SignoffRefused as exc:
            refused = exc
    elif isinstance(current, dict) and needs_override(data.get("verdict"), str(current.get("decision"))) and \
            not current.get("override"):  # written by a gpuaccept before the rule: never signed as it is
        refused = SignoffRefused(f"refused: the record's sign-off by {current.get('operator')!r} accepts a verdict "
                                 f"that is {verdict_in_words(data.get('verdict'))} without an override (the "
                                 "operator's reason); a record whose acceptance contradicts its verdict is not signed")
    schema, verdicts = record_problems(data)
    problems = schema + verdicts
    if problems:
        raise SigningError("not signed: the record does not verify (" + "; ".join(problems[:3])
                           + (" ..." if len(problems) > 3 else "") + "); gpuaccept verify shows every finding")
    if refused is not None:
        raise refused
    can_sign(key)
    if signoff is not None:
        try:
            add_signoff(record, signoff)
        except ValueError as exc:
            raise SigningError(str(exc)) from None
    return sign(record, key)
