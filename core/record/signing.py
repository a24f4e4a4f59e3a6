"""Signatures of acceptance records with OpenSSH's ``ssh-keygen -Y`` (namespace ``gpuaccept-record``).

This module signs and checks a file and nothing else: it imports no other module of :mod:`core.record` (the sign-off,
which checks the record before signing it, is :mod:`core.record.signoff`; an import contract in pyproject.toml keeps
the record package's modules in layers, so no cycle comes back).

The signature covers the exact bytes of ``record.toml`` on disk and is written beside it as ``record.toml.sig`` (what
``ssh-keygen -Y sign`` writes). A key is a private key file, or a public key file whose private half is in the
ssh-agent (``ssh-keygen`` then asks the agent). Nothing here prompts: ssh-keygen runs in a new session without a
terminal, so a passphrase-protected key file fails with a message that says to load it into the agent
(``ssh-add KEY``) and give its ``.pub``.

Source: ssh-keygen(1), "ALLOWED SIGNERS" and the ``-Y sign`` / ``-Y verify`` / ``-Y check-novalidate`` operations
(OpenSSH 8.2+; the ``-Y`` interface is stable since 8.2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from core.bounds import MAX_SMALL_FILE, InputFileError, read_input_text, special_file_kind
from core.errors import GpuAcceptError
from core.procgroup import end_group

NAMESPACE = "gpuaccept-record"

#: seconds ssh-keygen may take over one record (signing, checking): far more than it needs
SSH_KEYGEN_TIMEOUT_S = 60.0
#: bytes of a signature file ssh-keygen is given (an SSH signature is a few hundred bytes)
MAX_SIGNATURE_BYTES = 16_384


class SigningError(GpuAcceptError):
    """Signing could not be done (no ssh-keygen, no usable key, an existing signature); the message says what to do."""


@dataclass(frozen=True)
class SignatureCheck:
    """Outcome of checking ``record.toml.sig``.

    ``status``: ``good`` (valid over the bytes on disk; with allowed signers, by an allowed identity), ``bad`` (changed
    bytes, another namespace, an unreadable signature), ``signer_not_allowed`` (the signature is intact over the bytes
    on disk, but the identity given may not sign with its key in the allowed-signers file: a mix-up of names or keys,
    not a changed record) or ``unsigned`` (no .sig file).
    ``signer_checked`` says whether the signer was checked against an allowed-signers file or only the signature.
    """

    status: str
    detail: str
    fingerprint: str | None = None
    signer_checked: bool = False


def _ssh_keygen() -> str:
    exe = shutil.which("ssh-keygen")
    if exe is None:
        raise SigningError("ssh-keygen was not found: install OpenSSH's client tools (8.2 or newer) to sign records")
    return exe


def _run(args: list[str], stdin_path: Path | None = None) -> subprocess.CompletedProcess[Any]:
    # CompletedProcess[Any]: its output is text (str) without stdin_path and bytes with it
    env = dict(os.environ)
    env.pop("SSH_ASKPASS", None)  # never a pop-up; a key that needs a passphrase fails
    # a new session has no controlling terminal: ssh-keygen cannot open /dev/tty to ask for a passphrase, so a key
    # that needs one fails at once instead of prompting under the wizard or hanging a script
    with open(stdin_path, "rb") if stdin_path is not None else open(os.devnull, "rb") as fh:
        proc = subprocess.Popen(args, stdin=fh, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                text=stdin_path is None, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=SSH_KEYGEN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SigningError(f"ssh-keygen did not finish in {SSH_KEYGEN_TIMEOUT_S:.0f} s ({' '.join(args[1:3])}); "
                               "it was stopped") from None
        finally:  # a timeout, a signal turned into SystemExit, ^C: ssh-keygen (its own session) never outlives us
            end_group(proc)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def signature_path(record: Path) -> Path:
    """Where the signature of ``record`` lives: ``record.toml.sig``."""
    return record.with_name(record.name + ".sig")


def fingerprint(key: Path) -> str:
    """``ssh-keygen -l`` of a key file (private or public): bits, SHA256 fingerprint, comment, type.

    Raises:
        SigningError: the file is not a key ssh-keygen can read.
    """
    key = Path(key).expanduser()
    if key.is_dir():
        raise SigningError(f"{key} is a folder; give a key file: a private key or the .pub of a key in the ssh-agent")
    if not key.is_file():
        raise SigningError(f"key file {key} not found; give a private key or the .pub of a key in the ssh-agent")
    done = _run([_ssh_keygen(), "-l", "-f", str(key)])
    if done.returncode != 0:
        raise SigningError(f"{key} is not an SSH key ssh-keygen can read: {(done.stderr or done.stdout).strip()}")
    return cast(str, done.stdout).strip()  # text: _run without stdin_path


def agent_keys() -> list[str]:
    """Public keys the ssh-agent holds (``ssh-add -L``), one line each; empty without an agent."""
    exe = shutil.which("ssh-add")
    if exe is None or not os.environ.get("SSH_AUTH_SOCK"):
        return []
    done = subprocess.run([exe, "-L"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10)
    return [line for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def can_sign(key: Path) -> None:
    """Sign a scratch file with ``key`` to prove it can sign here (the key readable, its passphrase not needed or the
    key in the agent), before anything is changed.

    Raises:
        SigningError: saying why and what to do.
    """
    import tempfile

    key = Path(key).expanduser().resolve()
    fingerprint(key)
    with tempfile.TemporaryDirectory(prefix="gpuaccept-sign-") as tmp:
        probe = Path(tmp) / "probe.txt"
        probe.write_text("gpuaccept can-sign probe\n", encoding="utf-8")
        _sign_file(probe, key)


def _sign_file(path: Path, key: Path) -> Path:
    done = _run([_ssh_keygen(), "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(path)])
    sig = signature_path(path)
    if done.returncode != 0 or not sig.is_file():
        # ssh-keygen's own prompt text ends up in its error output when there is no terminal to ask on
        why = [w for w in (re.sub(r"Enter passphrase[^:]*:\s*", "", line).strip()
                           for line in (done.stderr or done.stdout).strip().splitlines()) if w]
        text = " ".join(why).lower()
        hint = ""
        if "passphrase" in text or "incorrect" in text or "load key" in text:
            hint = "; a key with a passphrase must be in the ssh-agent: run ssh-add KEY and give KEY.pub"
        elif "no private key" in text or "agent" in text:
            hint = "; a .pub signs only when its private key is in the ssh-agent (ssh-add -l lists them)"
        raise SigningError(f"ssh-keygen could not sign with {key}: {why[-1] if why else 'no output'}{hint}")
    return sig


def sign(record: Path, key: Path) -> Path:
    """Sign the bytes of ``record`` with ``key``; returns ``record.toml.sig``. A symlinked record is signed where it
    points.

    Raises:
        SigningError: the record is missing or already signed (a signature is never overwritten), or ssh-keygen
            refused (a passphrase-protected key that is not in the agent, an unreadable key).
    """
    record, key = Path(record).resolve(), Path(key).expanduser().resolve()
    if not record.is_file():
        raise SigningError(f"record {record} not found")
    sig = signature_path(record)
    if sig.exists():
        raise SigningError(f"{sig} already exists: a signed record is not signed again (start a new run)")
    fingerprint(key)  # a clear error for a missing or unreadable key before ssh-keygen's own
    return _sign_file(record, key)


def check_allowed_signers(path: Path) -> None:
    """Refuse an allowed-signers file ssh-keygen could not use, before it is given one: the file must be a regular file
    of UTF-8 text of at most :data:`core.bounds.MAX_SMALL_FILE` bytes holding at least one signer line,
    ``principals [options] key-type base64-key`` (ssh-keygen(1), "ALLOWED SIGNERS"), whose key decodes to a blob that
    starts with its own key type (the SSH wire format: RFC 4253 section 6.6).

    Raises:
        FileNotFoundError: no such file.
        SigningError: not a regular file, too large, not UTF-8, or no signer line; the message names the file.
    """
    try:
        text = read_input_text(path, "an allowed_signers file (ssh-keygen(1), ALLOWED SIGNERS)")
    except FileNotFoundError:
        raise FileNotFoundError(f"allowed-signers file {path} not found") from None
    except InputFileError as exc:
        raise SigningError(f"allowed-signers: {exc}") from None
    except OSError as exc:
        raise SigningError(f"allowed-signers {path} cannot be read ({exc.strerror or exc})") from None
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if any(_is_public_key(kind, key) for kind, key in zip(words[1:], words[2:])):
            return
    raise SigningError(f"allowed-signers {path} holds no signer line (principals [options] key-type base64-key, as "
                       "ssh-keygen(1) ALLOWED SIGNERS describes): give the file that lists the signer's public key")


def _is_public_key(kind: str, key: str) -> bool:
    """Whether ``key`` is the base64 of an SSH public key blob of type ``kind``: a uint32 length then the type name."""
    import base64
    import binascii

    if not kind.startswith(("ssh-", "ecdsa-", "sk-")) or len(key) > MAX_SMALL_FILE:
        return False
    try:
        blob = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        return False
    size = int.from_bytes(blob[:4], "big")
    return size == len(kind) and blob[4:4 + size] == kind.encode("ascii", "replace")


def check_signature(record: Path, allowed_signers: Path | None = None, identity: str | None = None) -> SignatureCheck:
    """Check ``record.toml.sig`` over the bytes of ``record`` in namespace ``gpuaccept-record``.

    With ``allowed_signers`` and ``identity``, ``ssh-keygen -Y verify`` also checks that the identity may sign with
    that key; without them, ``-Y check-novalidate`` checks the signature only and the result says the signer was not
    checked.
    """
    record = Path(record)
    sig = signature_path(record)
    kind = special_file_kind(sig)
    if kind is not None:
        return SignatureCheck("bad", f"{sig.name} is {kind}, not a signature file")
    if not sig.exists():
        return SignatureCheck("unsigned", f"no signature: {sig.name} does not exist")
    if sig.stat().st_size > MAX_SIGNATURE_BYTES:  # ssh-keygen would take minutes over it
        return SignatureCheck("bad", f"{sig.name} is {sig.stat().st_size:,} bytes; an SSH signature is under "
                                     f"{MAX_SIGNATURE_BYTES:,}")
    if allowed_signers is not None:
        if not identity:
            raise SigningError("--allowed-signers needs --identity: the signer's principal in that file")
        check_allowed_signers(Path(allowed_signers))
        args = [_ssh_keygen(), "-Y", "verify", "-f", str(allowed_signers), "-I", identity, "-n", NAMESPACE,
                "-s", str(sig)]
    else:
        args = [_ssh_keygen(), "-Y", "check-novalidate", "-n", NAMESPACE, "-s", str(sig)]
    try:
        done = _run(args, stdin_path=record)
    except SigningError as exc:  # it did not answer in time: the signature is not shown good
        return SignatureCheck("bad", str(exc))
    out = (done.stdout + done.stderr).decode("utf-8", "replace").strip()
    found = re.search(r"(SHA256:[A-Za-z0-9+/=]+)", out)
    fp = found.group(1) if found else None
    if done.returncode == 0:
        who = f"signer {identity} allowed by {allowed_signers}" if allowed_signers else \
            "signer not checked (no --allowed-signers)"
        return SignatureCheck("good", f"good signature over {record.name} ({NAMESPACE}, key {fp}); {who}", fp,
                              allowed_signers is not None)
    last = out.splitlines()[-1] if out else f"ssh-keygen exit {done.returncode}"
    if allowed_signers is not None:  # intact over these bytes? then the identity or the key is what does not match
        intact = _run([_ssh_keygen(), "-Y", "check-novalidate", "-n", NAMESPACE, "-s", str(sig)], stdin_path=record)
        if intact.returncode == 0:
            found = re.search(r"(SHA256:[A-Za-z0-9+/=]+)", (intact.stdout + intact.stderr).decode("utf-8", "replace"))
            fp = found.group(1) if found else fp
            return SignatureCheck("signer_not_allowed",
                                  f"the signature is intact over {record.name} (key {fp}), but {allowed_signers} does "
                                  f"not allow identity {identity} to sign with that key: check the identity and the "
                                  "allowed-signers file (the record's bytes are as signed)", fp, True)
    return SignatureCheck("bad", f"{sig.name} does not verify: {last}", fp, allowed_signers is not None)
