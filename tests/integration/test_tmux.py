"""gpuaccept as a real process in a real terminal (tmux, 80x24): keys in, screen text out."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (.ci/run installs it in CI)")


class Tmux:
    def __init__(self, tmp_path: Path) -> None:
        # the pid too: two xdist workers' tmp_path may share a name (a long test name is cut to 30 characters)
        self.socket = f"gpuaccept-test-{os.getpid()}-{tmp_path.name}"
        self.session = "t"

    def tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.session)

    def wait_for(self, *texts: str, timeout_s: float = 90.0) -> str:
        """The screen once every one of ``texts`` is on it (a slow machine may show a screen half drawn, its footer
        last: a footer's key is waited for, then asserted to be in the footer)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            shown = self.screen()
            if all(t in shown for t in texts):
                return shown
            time.sleep(0.2)
        raise AssertionError(f"{texts!r} not all on screen after {timeout_s} s; screen:\n{self.screen()}")


def keys(term: Tmux, *keys: str, pause_s: float = 0.3) -> None:
    """Type ``keys`` (tmux key names, or text) one at a time, as a person does."""
    for key in keys:
        term.tmux("send-keys", "-t", term.session, key)
        time.sleep(pause_s)


def burst(term: Tmux, *keys: str) -> None:
    """Type ``keys`` in one burst (one ``send-keys``): as fast as a paste, a macro or a practised hand, faster than the
    screen draws."""
    term.tmux("send-keys", "-t", term.session, *keys)


def exit_status(rc: Path, timeout_s: float = 20.0) -> str:
    """What the shell wrote to ``rc`` after gpuaccept ended ("exit=N"), once it is there."""
    deadline = time.monotonic() + timeout_s
    while not rc.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return rc.read_text().strip()


def footer(screen: str) -> str:
    """The screen's last line: the footer, where every key of the screen is named."""
    return screen.rstrip("\n").splitlines()[-1]


#: the walk's settings: the tiny model, the shortest runs that still reach every stage
WALK = ("--devices cpu --seq-len 64 --steps 6 --probe-steps 2 --eval-max-blocks 4 --checkpoint-every 2 "
        "--kill-after-checkpoint 1")


def test_a_cold_walk_with_keys_only_to_a_signed_record_and_the_quiz(tmp_path, tiny_model_dir):
    """Issue 34: the installed binary, started cold in a real terminal at 80x24, driven by keys alone from the mode to
    a signed record and the quiz; what each screen shows is read off the terminal, and the record is verified after.
    Each step waits for what a person waits for, and each footer names the key pressed next."""
    exe = Path(sys.executable).parent / "gpuaccept"
    key = tmp_path / "signing-key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "walker", "-f", str(key)], check=True)
    term = Tmux(tmp_path)
    command = f"cd {tmp_path} && {exe} run --model {tiny_model_dir} {WALK}; echo exit=$? > {tmp_path}/rc; sleep 60"
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24", command)
    try:
        mode = term.wait_for("Step 1/7 · Mode", "Inference", "Full fine-tuning", "LoRA", "Your own command", "⏎ Next")
        assert "⏎ Next" in footer(mode)
        keys(term, "Enter")
        # the setup opens checked, not broken: its two workers (devices, model and data) import side by side
        setup = term.wait_for("Step 2/7 · Setup (lora)", "documents:", "^o Own command", timeout_s=120)
        assert "Error" not in setup and "↑" not in setup, setup
        assert "^n Next" in footer(setup) and "^o Own command" in footer(setup)
        keys(term, "C-n")
        plan = term.wait_for("Step 3/7 · Plan (estimates)", "→ fits", "^n Probe")
        assert "micro-batch 4 × 64 tokens" in " ".join(plan.split())  # the line may wrap at 80 columns
        assert "^n Probe" in footer(plan)
        keys(term, "C-n")
        probe = term.wait_for("Step 4/7 · Probe (measured)", "PASS ·", "^n Next", timeout_s=180)
        assert "^n Next" in footer(probe)
        keys(term, "C-n")
        term.wait_for("Step 5/7 · Train + evaluate (measured)", "PASS · criterion", timeout_s=180)
        keys(term, "C-n")
        term.wait_for("Step 6/7 · Kill and resume (measured)", "PASS · killed", timeout_s=240)
        keys(term, "C-n")
        export = term.wait_for("Step 7/7 · Sign off", "overall: PASS", "^n Write record")
        assert "^n Write record" in footer(export) and "^q Quit" in footer(export), footer(export)
        # operator; Tab to the role, Tab to the decision, Enter opens its menu, ↓ Enter picks "accept"; all in one
        # burst (keys typed after Enter on the menu were lost: the signing key stayed empty, the record unsigned)
        burst(term, "walker", "Tab", "Tab", "Enter", "Down", "Enter", "Tab", "Tab", str(key))
        term.wait_for("key: 256 SHA256:", "walker (ED25519)")
        keys(term, "C-n")
        written = term.wait_for("record written, signed:", "^n Quiz")
        assert "^n Quiz" in footer(written), footer(written)
        keys(term, "C-n")
        term.wait_for("Onboarding check · question 1 of")
        for _ in range(12):  # answer 1 to each question, then n, until the score
            if "Onboarding check · score" in term.screen():
                break
            keys(term, "1", "n")
        score = term.wait_for("Onboarding check · score", " right.")
        assert "The record is signed, so it is never rewritten" in score
        keys(term, "Escape")
        term.wait_for("Step 7/7 · Sign off")
        keys(term, "C-q")
        assert exit_status(tmp_path / "rc") == "exit=0"
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)
    (record,) = (tmp_path / "runs").glob("*/record.toml")
    text = record.read_text()
    assert 'operator = "walker"' in text and 'decision = "accept"' in text
    assert record.with_name("record.toml.sig").is_file()
    signers = tmp_path / "allowed_signers"
    signers.write_text("walker " + " ".join(Path(f"{key}.pub").read_text().split()[:2]) + "\n")
    verified = subprocess.run([str(exe), "verify", str(record), "--allowed-signers", str(signers), "--identity",
                               "walker"], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_dropped_terminal_during_the_probe_ends_the_wizard_and_its_child_and_keeps_the_record(tmp_path, tiny_model_dir):
    """An SSH connection that drops closes the terminal: the wizard must not linger (it used to spin on the dead
    terminal), its probe child's process group must be gone, and what was measured is written, unsigned."""
    import psutil

    def ours() -> list:
        found = []
        for proc in psutil.process_iter(["cmdline", "cwd"]):
            try:
                cmd = " ".join(proc.info["cmdline"] or [])
                if ("core.child.worker" in cmd or cmd.endswith("gpuaccept run --model " + str(tiny_model_dir) + " --devices cpu "
                                                           "--seq-len 64 --probe-steps 100000")) and \
                        str(proc.info.get("cwd") or "").startswith(str(tmp_path)):
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    exe = Path(sys.executable).parent / "gpuaccept"
    term = Tmux(tmp_path)
    command = (f"cd {tmp_path} && {exe} run --model {tiny_model_dir} --devices cpu --seq-len 64 --probe-steps 100000; "
               "sleep 30")
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24", command)
    try:
        term.wait_for("Step 1/7 · Mode")
        term.tmux("send-keys", "-t", term.session, "Enter")
        term.wait_for("Step 2/7")
        term.tmux("send-keys", "-t", term.session, "C-n")
        term.wait_for("Step 3/7", "→ fits")
        term.tmux("send-keys", "-t", term.session, "C-n")
        term.wait_for("Step 4/7", "probe: step")  # its steps run (the probe is long: it is still running)
        assert len(ours()) >= 2  # the wizard and its probe child are running
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)

    deadline = time.monotonic() + 20
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ours() == []
    (record,) = (tmp_path / "runs").glob("*/record.toml")
    text = record.read_text()
    assert 'status = "unsigned"' in text and "cancelled" in text


def test_the_readmes_command_mode_example_walked_as_written(tmp_path):
    """Issue 34: the README's command-mode line, exactly as written (tests/readme_commands.py), typed in a shell at
    the repository's root with the venv not activated (the README's example once ran the system's python), then
    walked with keys: Mode (your own command, chosen by the flags) → the filled-in form → every stage → the sign-off,
    written with ^n; the record is consistent (verify: exit 3, unsigned)."""
    import shlex

    from tests.readme_commands import command_mode_line, user_env, user_root

    root = user_root(tmp_path / "repo")
    line = command_mode_line()
    env = user_env()
    term = Tmux(tmp_path)
    shell = f"cd {shlex.quote(str(root))} && PATH={shlex.quote(env['PATH'])} {line}; echo exit=$? > {tmp_path}/rc; sleep 60"
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24", "-e", "VIRTUAL_ENV=", shell)
    try:
        from core.methods import METHODS

        term.wait_for("Step 1/4 · Mode", f"▐●▌ {len([m for m in METHODS.values() if m.runs]) + 1}  Your own command", "⏎ Next")  # after the methods
        keys(term, "Enter")
        form = term.wait_for("Step 2/4 · Your own command", "Resume command", "^n Next")
        assert "{command} --resume {checkpoint}" in form
        # the criteria, on the same form, by keys: Tab past the command's fields to Max step time
        from tui.screens.command import CRITERIA, FIELDS

        keys(term, *["Tab"] * (len(FIELDS) + [n for n, *_ in CRITERIA].index("max_step_time_s")), "600")
        deadline = time.monotonic() + 30
        while not re.search(r"Max step time, s\s+600\s", term.screen()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert re.search(r"Max step time, s\s+600\s", term.screen()), term.screen()
        keys(term, "C-n")
        done = term.wait_for("Step 3/4", "✓ kill and resume pass", "^n Next", timeout_s=600)
        assert "✓ uninterrupted run (probe) pass" in done and "✓ evaluation pass" in done, done
        keys(term, "C-n")
        term.wait_for("Step 4/4 · Sign off", "overall: PASS", "^n Write record")
        keys(term, "walker", "Tab", "Tab", "Enter", "Down", "Enter")
        keys(term, "C-n")
        written = term.wait_for("^o Compare runs")
        deadline = time.monotonic() + 30
        while "^n Write record" in footer(written) and time.monotonic() < deadline:
            time.sleep(0.2)
            written = term.screen()
        assert "^n Write record" not in footer(written) and "^n Quiz" not in footer(written)  # no quiz in command mode
        keys(term, "C-q")
        assert exit_status(tmp_path / "rc") == "exit=0"
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)
    (record,) = (root / "runs" / "command").glob("*/record.toml")
    text = record.read_text()
    assert 'operator = "walker"' in text and 'decision = "accept"' in text and "max_step_time_s = 600.0" in text
    exe = Path(sys.executable).parent / "gpuaccept"
    verified = subprocess.run([str(exe), "verify", str(record)], capture_output=True, text=True)
    assert verified.returncode == 3, verified.stdout + verified.stderr  # consistent, unsigned
    # four checkpoints of a full fine-tune with AdamW's moments (6.1 GB): gone as soon as the test has passed
    for checkpoint in record.parent.glob("*/out/checkpoint-*"):
        shutil.rmtree(checkpoint)


def tab_until(term: Tmux, shown: str, pattern: str, tabs: int = 16) -> str:
    """The screen once `pattern` shows on it, pressing Tab (focus scrolls the form) up to `tabs` times."""
    for _ in range(tabs):
        if re.search(pattern, shown):
            break
        keys(term, "Tab")
        time.sleep(0.3)
        shown = term.screen()
    return shown


def test_setup_reads_a_trainers_config_with_keys_only(tmp_path, tiny_model_dir):
    """Setup's "from a config file" in a real terminal: ^l (named in the footer), the path typed, Enter; Setup comes back
    on the config's mode (TRL's QLoRA) saying which file its values came from; a config that leaves the sequence
    length to the data asks for it, and the typed value reaches Setup."""
    exe = Path(sys.executable).parent / "gpuaccept"
    # the config names its model MODEL: this one names the test's model, as a user's config names theirs (a model
    # not found would put its long error under Model and push the fields below off the 24 rows)
    source = Path(__file__).resolve().parents[1] / "data" / "configs" / "trl_sft_qlora.yaml"
    config = tmp_path / source.name
    config.write_text(source.read_text(encoding="utf-8").replace("MODEL", str(tiny_model_dir)), encoding="utf-8")
    tuned = tmp_path / "torchtune_lora.yaml"
    tuned.write_text((source.parent / tuned.name).read_text(encoding="utf-8").replace("MODEL", str(tiny_model_dir))
                     .replace("max_seq_len: 2048", "max_seq_len: null"), encoding="utf-8")
    term = Tmux(tmp_path)
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24",
              f"cd {tmp_path} && {exe} run --model {tiny_model_dir} --devices cpu; sleep 30")
    try:
        term.wait_for("Step 1/7 · Mode", "⏎ Next")
        keys(term, "Enter")
        setup = term.wait_for("Step 2/7 · Setup (lora)", "^l From config")
        assert "^l From config" in footer(setup)
        keys(term, "C-l")
        term.wait_for("From a config file", "⏎ Load")
        keys(term, str(config), "Enter")
        shown = term.wait_for("Step 2/7 · Setup (qlora)", "imported from trl config")
        # the banner and the data's line name the pytest temp paths: at 80 columns they wrap onto as many rows as
        # those paths are long, so a field may be below the fold (CI failed on it once): Tab to it
        shown = tab_until(term, shown, r"Micro-batch / device\s+2\s")
        assert re.search(r"Micro-batch / device\s+2\s", shown), shown
        shown = tab_until(term, shown, r"Sequence length\s+512\s")  # the field under it
        assert re.search(r"Sequence length\s+512\s", shown), shown
        assert "^r Keys read" in footer(term.wait_for("^r Keys read"))  # every key as read, a key away (issue 51)
        keys(term, "C-r")
        listed = term.wait_for("replaced in Setup:", "esc Close")  # "each key of the file:" may be below the fold
        assert "mode lora → qlora" in listed, listed
        keys(term, "Escape")
        term.wait_for("Step 2/7 · Setup (qlora)", "^l From config")
        # a config that leaves the sequence length to the data (torchtune's max_seq_len: null): asked for, typed
        keys(term, "C-l")
        term.wait_for("From a config file", "⏎ Load")
        keys(term, str(tuned), "Enter")
        term.wait_for("tokenizer.max_seq_len", "type it above and press Enter")
        keys(term, "128", "Enter")
        shown = term.wait_for("Step 2/7 · Setup (lora)", "imported from torchtune config")
        assert re.search(r"Sequence length\s+128\s", tab_until(term, shown, r"Sequence length\s+128\s")), shown
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)


@pytest.mark.parametrize("order", ["before", "after"])
def test_every_modes_record_verifies_whether_the_probe_starts_before_or_after_the_trace(tmp_path, tiny_model_dir,
                                                                                       order):
    """Issue 51: a record the wizard wrote failed `verify` (DoRA, Ctrl+N on Plan before the traced plan arrived: the
    probe was compared with the analytic plan, the record held the traced one). The installed binary, cold, at 80x24,
    keys only: each Mode entry of gpuaccept's recipe in turn, Ctrl+N on Plan before the trace arrives (as soon as the
    plan fits) or after it (scrolled to, read off the screen), the probe run, then back to Mode for the next; each
    run's record is written when the next setup starts (and the last on quit). `verify` accepts every one: exit 3."""
    from tui.screens.mode import MODES

    exe = Path(sys.executable).parent / "gpuaccept"
    term = Tmux(tmp_path)
    command = f"cd {tmp_path} && {exe} run --model {tiny_model_dir} {WALK}; echo exit=$? > {tmp_path}/rc; sleep 60"
    term.tmux("new-session", "-d", "-s", term.session, "-x", "80", "-y", "24", command)
    modes = [m for m in MODES if m != "command"]
    try:
        for number, mode in enumerate(modes, 1):
            term.wait_for("· Mode", "⏎ Next")
            keys(term, str(number), "Enter")
            term.wait_for(f"· Setup ({mode})", "^n Next", timeout_s=120)
            keys(term, "C-n")
            plan = term.wait_for("· Plan (estimates)", "→ fits", "^n Probe")
            if order == "after":  # the traced plan is below the fold: End scrolls to it
                deadline = time.monotonic() + 120
                while not re.search(r"Traced plan, ESTIMATE|traced plan: (not_run|error|cancelled)", plan):
                    assert time.monotonic() < deadline, plan
                    keys(term, "End")
                    plan = term.screen()
            keys(term, "C-n")
            probe = term.wait_for("· Probe (measured)", "^n Next", timeout_s=180)
            deadline = time.monotonic() + 180
            while not re.search(r"(PASS|FAIL) ·", probe):
                assert time.monotonic() < deadline, probe
                time.sleep(0.5)
                probe = term.screen()
            assert "PASS ·" in probe, probe
            if number < len(modes):
                keys(term, "Escape", "Escape", "Escape")  # Plan, Setup, Mode
        keys(term, "q")
        assert exit_status(tmp_path / "rc", timeout_s=60) == "exit=0"
    finally:
        subprocess.run([TMUX, "-L", term.socket, "kill-server"], capture_output=True)
    records = sorted((tmp_path / "runs").glob("*/record.toml"))
    assert len(records) == len(modes), records
    for record in records:
        verified = subprocess.run([str(exe), "verify", str(record)], capture_output=True, text=True)
        assert verified.returncode == 3, record.parent.name + "\n" + verified.stdout + verified.stderr
