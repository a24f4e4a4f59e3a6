"""The sign-off: who accepts or rejects a record, put into it, checked, then signed.

The order is one function, :func:`sign_record`: the key must be able to sign, the record must conform to its schema and
every verdict must follow from its data (:func:`core.record.verify.record_problems`), then the sign-off is written
into the record (atomically) and its bytes are signed (:func:`core.record.signing.sign`). Nothing is changed unless
all of it can be done.

This module is the top of the record package's layers (pyproject.toml, ``[[tool.importlinter.contracts]]``): it
imports :mod:`core.record.verify`, :mod:`core.record.build` and :mod:`core.record.signing`; none of them imports it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from core.record.build import utc_now, write_record
from core.record.signing import SigningError, can_sign, sign, signature_path
from core.record.verify import record_problems


def make_signoff(operator: str, decision: str, role: str = "", comment: str = "") -> dict[str, Any]:
    """A ``signoff`` table: who decided what, in which role, why, when (UTC).

    Raises:
        ValueError: an empty operator or a decision other than accept / reject.
    """
    if not operator.strip():
        raise ValueError("name the operator who signs off")
    if decision not in ("accept", "reject"):
        raise ValueError(f"the decision is accept or reject (got {decision!r})")
    return {"operator": operator.strip(), "role": role.strip(), "decision": decision, "comment": comment.strip(),
            "time_utc": utc_now()}


def add_signoff(path: Path, signoff: dict[str, Any]) -> dict[str, Any]:
    """Put ``signoff`` into the unsigned record at ``path`` and rewrite it atomically; returns the record.

    Raises:
        ValueError: the record already holds a sign-off, or is already signed (``record.toml.sig`` exists).
    """
    path = Path(path)
    if signature_path(path).exists():
        raise ValueError(f"{path} is already signed; a signed record is never rewritten")
    record = tomllib.loads(path.read_text(encoding="utf-8"))
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
    verdict follow from its data (:func:`core.record.verify.record_problems`); the key must sign a scratch file
    (:func:`core.record.signing.can_sign`); then the sign-off is written into the record (atomically) and its bytes
    signed. A symlink is followed.

    Returns:
        the path of the signature, ``record.toml.sig``.

    Raises:
        SigningError: what stopped it, with what to do; the record is untouched.
    """
    record = Path(record).resolve()
    if not record.is_file():
        raise SigningError(f"record {record} not found")
    if signature_path(record).exists():
        raise SigningError(f"{signature_path(record)} already exists: a signed record is not signed again")
    try:
        data = tomllib.loads(record.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SigningError(f"{record} is not a gpuaccept record (not TOML: {exc})") from None
    current = data.get("signoff", {})
    if signoff is None and current.get("status") == "unsigned":
        raise SigningError("the record has no sign-off: give --operator NAME --decision accept|reject")
    if signoff is not None:
        if current.get("status") != "unsigned":
            raise SigningError(f"the record already holds a sign-off by {current.get('operator')!r} "
                               f"({current.get('decision')}); sign it as it is, without --operator")
        data["signoff"] = signoff
    schema, verdicts = record_problems(data)
    problems = schema + verdicts
    if problems:
        raise SigningError("not signed: the record does not verify (" + "; ".join(problems[:3])
                           + (" ..." if len(problems) > 3 else "") + "); gpuaccept verify shows every finding")
    can_sign(key)
    if signoff is not None:
        try:
            add_signoff(record, signoff)
        except ValueError as exc:
            raise SigningError(str(exc)) from None
    return sign(record, key)
