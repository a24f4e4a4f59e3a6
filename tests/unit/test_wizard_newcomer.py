"""Issue 17: the wizard as a newcomer meets it. Each test is one thing a new user found at 80x24."""

from __future__ import annotations

import re

import pytest
from textual.widgets import RadioButton

from tests.wizard_helpers import make_app
from tui.screens.mode import ModeChoice, ModeScreen
from tui.screens.setup import SetupScreen


async def to_plan(pilot, app) -> None:
    """Mode (Enter) → Setup (Ctrl+N) → the Plan, once it can go on."""
    from tests.wizard_helpers import wait_for
    from tui.screens.plan import PlanScreen

    await pilot.press("enter", "ctrl+n")
    assert isinstance(app.screen, PlanScreen)
    await wait_for(pilot, lambda: not app.screen.query_one("#next").disabled, 60)


@pytest.mark.parametrize(("keys", "mode"), [(["up"], "full"), (["up", "up"], "inference"), (["down"], "qlora"),
                                            (["down", "down", "down", "down"], "inference"), (["2", "down"], "lora"), ([], "lora")])
async def test_the_mode_under_the_cursor_is_the_mode_that_runs(tiny_model_dir, tmp_path, keys, mode):
    """The cursor started on "1 Inference" while LoRA was chosen; ↓ to "Full fine-tuning" and Enter ran LoRA."""
    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        choice = app.screen.query_one(ModeChoice)
        assert choice._selected == 2  # the highlight starts on the chosen mode
        await pilot.press(*keys, "enter")
        assert isinstance(app.screen, SetupScreen) and app.state.mode == mode
        assert f"Setup ({mode})" in str(app.screen.query_one(".title").content)


@pytest.mark.parametrize(("key", "mode"), [("4", "qlora"), ("down", "qlora"), ("up", "full")])
async def test_a_mode_key_and_enter_typed_together_run_that_mode(tiny_model_dir, tmp_path, key, mode):
    """Found driving `make run` in tmux: "4" and Enter sent at once ran LoRA (the mode before "4"), because the radio's
    Changed message came after the queued Enter. Both keys are queued here before the app handles either."""
    from textual import events

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        app.post_message(events.Key(key, key if len(key) == 1 else None))
        app.post_message(events.Key("enter", "\r"))
        await pilot.pause()
        assert isinstance(app.screen, SetupScreen) and app.state.mode == mode


async def test_ctrl_n_is_next_on_the_mode_screen_too(tiny_model_dir, tmp_path):
    app = make_app(tiny_model_dir, tmp_path, mode="full")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, SetupScreen) and app.state.mode == "full"


async def test_the_chosen_mode_shows_without_colour(tiny_model_dir, tmp_path):
    """In plain text all three radios rendered as ●."""
    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        assert isinstance(app.screen, ModeScreen)
        marks = {b.id: str(b.render()).split()[0] for b in app.screen.query(RadioButton)}
        assert marks == {"inference": "▐○▌", "full": "▐○▌", "lora": "▐●▌", "qlora": "▐○▌", "dora": "▐○▌",
                         "command": "▐○▌"}, marks
        await pilot.press("up")
        marks = {b.id: str(b.render()).split()[0] for b in app.screen.query(RadioButton)}
        assert marks["full"] == "▐●▌" and marks["lora"] == "▐○▌"


async def test_qlora_says_what_differs_from_lora_and_asks_for_its_4_bit_settings(tiny_model_dir, tmp_path):
    """Key 4 picks the variant; its text says what the 4-bit base changes and what stays as LoRA's; its Setup asks
    for the 4-bit type and double quantisation beside LoRA's fields, and offers no precision (pure only) or
    strategy (one process): the settings it would refuse are not offered."""
    from tests.wizard_helpers import text_of

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("4")
        help_text = text_of(app.screen.query_one("#mode-help"))
        assert "4 bits" in help_text and "same adapters" in help_text and "as for LoRA" in help_text
        await pilot.press("enter")
        assert isinstance(app.screen, SetupScreen) and app.state.mode == "qlora"
        ids = {w.id for w in app.screen.query("Select, Input")}
        assert {"qlora_quant_type", "qlora_double_quant", "lora_r", "lora_targets", "optimizer"} <= ids
        assert not ids & {"precision", "strategy", "torchrun_nproc_per_node"}
        assert str(app.screen.query_one("#qlora_quant_type").value) == "nf4"


# ------------------------------------------------------------------------------- a plan that does not fit
def _small_host_app(tiny_model_dir, tmp_path, batch: int):
    """The wizard on a host whose capacity lies between the plans of micro-batch 2 and 3 (planned here, not
    invented), with micro-batch ``batch``."""
    from core.monitor.sampler import ReplayBackend, constructed_frames
    from core.plan.devices import DeviceInfo
    from core.prerun import make_plan
    from core.spec import RunSpec
    from tests.wizard_helpers import TEST_HOST, GiB
    from tui.app import GpuAcceptApp

    def total(b):
        spec = RunSpec.build(model=str(tiny_model_dir), mode="lora", seq_len=64, batch_size=b)
        return make_plan(spec, [TEST_HOST]).plan.devices[0].total_bytes

    capacity = (total(2) + total(3)) // 2
    host = DeviceInfo("cpu", "cpu", "small host", capacity, "constructed for tests")
    frames = constructed_frames(device="cpu", name="small host", total=capacity, ours=[None, GiB // 8], others=0)
    return GpuAcceptApp(runs_root=tmp_path, backend=ReplayBackend(frames), devices_override=[host], mode="lora",
                        tracer=lambda spec, ctx, cancelled=None: {"status": "not_run", "reason": "not traced here"},
                        fields={"model": str(tiny_model_dir), "seq_len": 64, "batch_size": batch, "steps": 6,
                                "eval_max_blocks": 4, "resume_checkpoint_every": 2,
                                "resume_kill_after_checkpoint": 1, "probe_steps": 2})


async def test_a_plan_that_does_not_fit_offers_the_largest_batch_that_fits_and_a_probe_anyway(tiny_model_dir, tmp_path):
    """It was a dead end: "Run the probe →" disabled, no way to probe anyway, no hint of what would fit, and the
    footer still offered ^n Probe."""
    from textual.widgets import Button

    from tests.wizard_helpers import wait_for
    from tui.screens.plan import PlanScreen

    app = _small_host_app(tiny_model_dir, tmp_path, batch=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter", "ctrl+n")
        assert isinstance(app.screen, PlanScreen)
        nxt = app.screen.query_one("#next", Button)
        await wait_for(pilot, lambda: str(nxt.label) != "Run the probe →" or not nxt.disabled, 60)
        assert str(nxt.label) == "p: Probe anyway →" and not nxt.disabled
        assert app.screen.check_action("probe_anyway", ()) is True  # its key, named in the footer
        error = str(app.screen.query_one("#plan-error").content)
        # the host lies between the plans of 2 and 3: micro-batch 2 leaves a thin margin, and the offer says so
        assert ("the plan does not fit: micro-batch 2 fits (f) with under 5 % of the device left: a little less free "
                "memory and it does not; or probe anyway (p)") in error, error
        assert app.screen.check_action("next", ()) is None  # ^n dimmed: only the button probes an unfit plan
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, PlanScreen)
        await pilot.press("f")  # take the largest micro-batch that fits
        await wait_for(pilot, lambda: app.state.spec.batch_size == 2 and str(nxt.label) == "Run the probe →", 60)
        assert not nxt.disabled and app.screen.check_action("next", ()) is True
        assert not app.screen.query_one("#use-largest").display
        assert app.screen.check_action("probe_anyway", ()) is False  # a plan that fits: ^n probes, p is not offered


async def test_b_on_plan_says_at_once_that_it_replans_and_dims_the_old_plan(tiny_model_dir, tmp_path):
    """Issue 51: after b the old numbers stayed for 2-3 s with no "replanning" (the first b seemed to do nothing)."""
    from textual.widgets import Button

    from tests.wizard_helpers import make_app, wait_for
    from tui.screens.plan import PlanScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora", batch_size=4)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter", "ctrl+n")
        assert isinstance(app.screen, PlanScreen)
        nxt = app.screen.query_one("#next", Button)
        await wait_for(pilot, lambda: not nxt.disabled, 60)
        app.screen.replan = lambda spec: None  # the new plan never comes: what shows meanwhile is the point
        await pilot.press("b")
        error = str(app.screen.query_one("#plan-error").content)
        assert error.startswith("replanning for micro-batch 2 × 64 tokens (was 4 × 64)"), error
        assert app.screen.query_one("#plan-body").has_class("stale") and nxt.disabled
        assert app.screen.next_blocked() == error  # ^n says why it waits


# ------------------------------------------------------------------------- the setup checks what the plan would
@pytest.mark.parametrize(("field", "value", "says"), [
    ("model", "/no/such/model-dir", "model"),
    ("lora_targets", "q_proj,qq_proj", "qq_proj"),
    ("data", "missing.jsonl", "not found"),
], ids=["mistyped-model", "unknown-lora-target", "missing-data"])
async def test_setup_names_what_the_plan_would_refuse_before_next(tiny_model_dir, tmp_path, field, value, says):
    from textual.widgets import Button, Input

    from tests.wizard_helpers import text_of, wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        screen.query_one(f"#{field}", Input).value = value
        await wait_for(pilot, lambda: screen.query_one(f"#err-{field}").display, 30)
        assert says in text_of(screen.query_one(f"#err-{field}")), text_of(screen.query_one(f"#err-{field}"))
        assert screen.query_one("#next", Button).disabled
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, SetupScreen)


async def test_setup_shows_every_field_at_fault_at_once(tiny_model_dir, tmp_path):
    """A bad model hid the data and sequence errors before: one error at a time, found by fixing each in turn."""
    from textual.widgets import Button, Input

    from tests.wizard_helpers import text_of, wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        for field, value in (("model", "/no/such/model-dir"), ("data", str(tmp_path / "missing.jsonl")),
                             ("batch_size", "0"), ("lora_r", "zero"), ("seq_len", "1")):
            screen.query_one(f"#{field}", Input).value = value
        await wait_for(pilot, lambda: screen.query_one("#err-model").display, 30)
        said = {f: text_of(screen.query_one(f"#err-{f}")) for f in ("model", "data", "batch_size", "lora_r", "seq_len")}
        assert "/no/such/model-dir" in said["model"], said
        assert "not found" in said["data"], said
        assert "at least 1" in said["batch_size"], said
        assert "whole number" in said["lora_r"], said
        assert "at least 2 tokens" in said["seq_len"], said
        assert screen.query_one("#next", Button).disabled
        # fixed one by one, each error goes as its field is fixed, and the others stay
        screen.query_one("#model", Input).value = str(tiny_model_dir)
        screen.query_one("#batch_size", Input).value = "2"
        await wait_for(pilot, lambda: not screen.query_one("#err-model").display, 30)
        assert not screen.query_one("#err-batch_size").display
        assert screen.query_one("#err-data").display and screen.query_one("#err-seq_len").display


async def test_a_too_long_sequence_and_an_unknown_lora_target_are_both_named(tiny_model_dir, tmp_path):
    """Both are refused by the model's config: the first hid the second."""
    from textual.widgets import Input

    from tests.wizard_helpers import text_of, wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora", seq_len=4096)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        screen.query_one("#lora_targets", Input).value = "q_proj,qq_proj"
        await wait_for(pilot, lambda: screen.query_one("#err-lora_targets").display, 30)
        assert "max_position_embeddings (256)" in text_of(screen.query_one("#err-seq_len"))
        assert "qq_proj not found" in text_of(screen.query_one("#err-lora_targets"))


async def test_a_jsonl_line_without_text_is_named_on_the_setup_and_good_data_is_counted(tiny_model_dir, tmp_path):
    """Found only inside the probe child before (exit 1 and a failed record); and your own data was invisible."""
    from textual.widgets import Button, Input

    from tests.wizard_helpers import text_of, wait_for

    bad, good = tmp_path / "bad.jsonl", tmp_path / "good.jsonl"
    bad.write_text('{"text": "one"}\n{"body": "two"}\n')
    good.write_text("".join(f'{{"text": "document number {i} with some words"}}\n' for i in range(40)))
    app = make_app(tiny_model_dir, tmp_path, mode="lora", data=str(bad))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        assert screen.query_one("#data", Input).value == str(bad)  # what you give is what you see
        await wait_for(pilot, lambda: screen.query_one("#err-data").display, 30)
        assert 'line 2: no "text" key' in text_of(screen.query_one("#err-data"))
        assert screen.query_one("#next", Button).disabled
        screen.query_one("#data", Input).value = str(good)
        await wait_for(pilot, lambda: "documents:" in text_of(screen.query_one("#data-info")), 30)
        from core.data import check_data

        split = check_data(str(good), 0.2)
        info = text_of(screen.query_one("#data-info"))
        assert f"40 documents: {len(split.train)} train / {len(split.heldout)} held-out" in info, info
        assert not screen.query_one("#next", Button).disabled


async def test_the_export_screen_says_what_signing_freezes_before_you_sign(tiny_model_dir, tmp_path):
    from tests.wizard_helpers import text_of
    from tui.screens.export import ExportScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        app.push_screen(ExportScreen())
        await pilot.pause()
        note = text_of(app.screen.query_one("#sign-note"))
        assert "Signing freezes record.toml" in note and "quiz" in note
        # above the fold at 80x24, whatever the body scrolls to: it is not in the scrolled body
        region = app.screen.query_one("#sign-note").region
        assert region.height > 0 and region.y + region.height <= 24 - 4, region  # above the buttons and footer
        assert app.screen.query_one("#sign-note").parent is app.screen


async def test_at_60_columns_the_probe_bar_keeps_its_peak():
    """At 60x20 the probe's memory line lost its peak (it came last and was cut)."""
    from textual.app import App

    from tui.widgets.bars import LiveBar

    class One(App):
        def compose(self):
            yield LiveBar("cuda:0 NVIDIA H200", id="bar")

    app = One()
    async with app.run_test(size=(60, 20)) as pilot:
        bar = app.query_one(LiveBar)
        bar.show(ours=3 * 2**30, others=10 * 2**30, total=140 * 2**30, peak=5 * 2**30, note="a long reason " * 4)
        await pilot.pause()
        line = str(bar.render()).splitlines()[1]
        # every number with its unit (issue 34): at 60 columns the probe's share, its peak and the total fit, the
        # others' share is left to the bar
        assert len(line) <= 60 and line.startswith("■ probe 3.00 GiB (peak 5.00 GiB) / 140.00 GiB"), line
        # the note is what is cut, and it says so
        assert line.rstrip().endswith("…"), line
        # narrower still (a finished probe beside a scrollbar): the compact words, never a word cut ("GiB tot")
        bar.styles.width = 54
        bar.show(ours=None, others=int(1.5 * 2**30), total=int(23.54 * 2**30), peak=int(3.03 * 2**30), ended=True)
        await pilot.pause()
        line = str(bar.render()).splitlines()[1]
        assert line.rstrip() == "■ probe ended (peak 3.03 GiB) / 23.54 GiB", line


async def test_a_long_device_name_gets_its_own_line_and_the_bar_says_which_run_it_follows():
    """Issue 51: at 80 columns the probe bar's caption was cut, and command mode's resumed run was labelled "probe"."""
    from textual.app import App

    from tui.widgets.bars import LiveBar

    name = "cpu Intel(R) Xeon(R) Platinum 8480+ (2 cores)"

    class Two(App):
        def compose(self):
            yield LiveBar(name, id="long")
            yield LiveBar("cuda:0 NVIDIA H200", id="short", follows="resumed")

    async with Two().run_test(size=(80, 20)) as pilot:
        long, short = pilot.app.query_one("#long", LiveBar), pilot.app.query_one("#short", LiveBar)
        for bar in (long, short):
            bar.show(ours=3 * 2**30, others=2**30, total=64 * 2**30, peak=4 * 2**30)
        await pilot.pause()
        lines = long.render().plain.splitlines()
        assert len(lines) == 3 and lines[0] == name and long.size.height == 3, lines
        lines = short.render().plain.splitlines()
        assert len(lines) == 2 and lines[0].startswith("cuda:0 NVIDIA H200 ") and short.size.height == 2
        assert lines[1].startswith("■ resumed 3.00 GiB (peak 4.00 GiB)"), lines


async def test_the_perplexity_before_stays_on_screen_while_the_training_runs(tiny_model_dir, tmp_path):
    """It was a status line, replaced by the first training step."""
    import time

    from core.events import Evaluated, Progress, Waiting
    from tests.wizard_helpers import text_of
    from tui.screens.messages import StageEvent
    from tui.screens.stages import EvaluateScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        screen = EvaluateScreen()
        screen.run_stage = lambda: None  # drawn from events sent here, no child process
        await app.push_screen(screen)
        line = "held-out perplexity before training: 23.508 (4064 tokens, 4.9 s of evaluation)"
        # the stage says the child's next phase, then the evaluation that ended the one before (its order)
        screen.post_message(StageEvent(Waiting("train_eval", run="train", pid=4242, what="building the trainer",
                                               since=time.time() - 12.4)))
        screen.post_message(StageEvent(Evaluated("train_eval", text=line, when="before", perplexity=23.508)))
        await pilot.pause()
        # said once: it was both the status line and the result line until the first step ended
        shown = [text_of(w) for w in screen.query("Static")]
        assert sum(line in t for t in shown) == 1, shown
        # what the child does until its first step is the status line, with the seconds elapsed (issue 34)
        # (12.4 s before the message, counted when drawn: 13 s or more on a loaded machine)
        status = text_of(screen.query_one("#status"))
        assert re.fullmatch(r"train: building the trainer in child 4242… (\d+) s", status), status
        assert 12 <= int(status.split("… ")[1].split()[0]) <= 20, status
        for step, loss in ((1, 3.4), (2, 3.1)):
            screen.post_message(StageEvent(Progress("train_eval", run="train", step=step, total=6, loss=loss)))
            await pilot.pause()
        assert "train: step 2 (of 6)" in text_of(screen.query_one("#status"))
        assert line in text_of(screen.query_one("#eval-result"))
        # the loss curve's scale while it grows, not only at the end
        assert text_of(screen.query_one("#loss-title")) == "loss per step: 3.400 → 3.100 (min 3.100, max 3.400)"


def test_the_resume_progress_names_the_kill_point_as_the_check_does():
    """It said "SIGKILL after step 26" where the check said "inside step 26 ... before its optimizer step"."""
    from core.events import Progress
    from core.spec import RunSpec
    from tui.screens.stages import progress_text

    spec = RunSpec.build(mode="lora", steps=30, resume_checkpoint_every=10, resume_kill_after_checkpoint=2)
    line = progress_text(Progress("resume", run="interrupted", step=24, total=26, loss=1.5), spec)
    # the step done and the planned kill apart (issue 34: "step 11 (SIGKILL inside step 26, …)" mixed them)
    assert line == ("interrupted run (1 of 2): step 24 of 26 (to be SIGKILLed inside step 26, after micro-batch 1 of 1, "
                    "before its optimizer step), loss 1.5000")
    assert spec.resume.describe(short=True) in line
    assert progress_text(Progress("resume", run="resumed", step=22, total=30, loss=None), spec) == \
        "resumed run (2 of 2): step 22 (of 30)"


def test_the_resume_progress_bar_goes_through_both_runs_and_never_back():
    """It went from 96 % to 90 %: the bar restarted for the resumed run without a word."""
    from core.events import Progress
    from tui.screens.stages import ResumeScreen

    screen = ResumeScreen()
    seen = [screen.bar_progress(Progress("resume", run=run, step=step, total=total))
            for run, step, total in (("interrupted", 11, 26), ("interrupted", 25, 26), ("resumed", 21, 30),
                                     ("resumed", 30, 30))]
    fractions = [done / total for total, done in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0, fractions
    assert fractions[1] < 0.5 < fractions[2]  # the interrupted run fills the first half, the resumed the second
    twin = ResumeScreen()  # with a twin run (a tier that measures the noise), it fills the first third
    seen = [twin.bar_progress(Progress("resume", run=run, step=step, total=total))
            for run, step, total in (("twin", 6, 12), ("interrupted", 11, 11), ("resumed", 12, 12))]
    assert [round(done / total, 3) for total, done in seen] == [0.167, 0.667, 1.0]


def test_a_largest_fit_with_under_5_percent_left_is_said_to_be_thin():
    """f offered micro-batch 111 with 0.07 GiB of 23 GiB left, without a word of caution (the offer now says so)."""
    from core.plan.search import Largest

    thin = Largest("cpu", "batch_size", 111, plan_bytes=22_910_000_000, capacity_bytes=22_980_000_000,
                   limit="batch_size = 112 does not fit")
    roomy = Largest("cpu", "batch_size", 50, plan_bytes=10 * 2**30, capacity_bytes=22_980_000_000, limit="x")
    assert thin.thin and not roomy.thin


async def test_keys_typed_faster_than_the_screen_draws_land_in_order(tiny_model_dir, tmp_path):
    """Pasted over SSH or sent by tmux, "Ctrl+U then a path" lost the path (the bound key ran after the characters,
    Textual issue 6605) and characters typed after Tab landed in the field being left."""
    from textual import events
    from textual.widgets import Input

    from tests.wizard_helpers import wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        assert app.focused is screen.query_one("#model", Input)
        # all queued before any is handled, as a burst from the terminal is
        for key in ["ctrl+u", *"/x", "tab", "ctrl+u", *"bc", "backspace", "d", "left", "e"]:
            app.post_message(events.Key(key, key if len(key) == 1 else None))
        await wait_for(pilot, lambda: screen.query_one("#data", Input).value == "bed", 10)
        assert screen.query_one("#model", Input).value == "/x"
        assert app.focused is screen.query_one("#data", Input)


async def test_where_q_types_into_a_field_ctrl_q_quits_and_the_footer_says_so(tiny_model_dir, tmp_path):
    from textual.widgets import Input

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, SetupScreen)
        await pilot.press("end", "q")
        assert screen.query_one("#model", Input).value.endswith("q")  # q is a letter in a field
        assert app.is_running
        shown = {k for k, b in screen.active_bindings.items() if b.binding.show}
        assert "ctrl+q" in shown, shown
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert not app.is_running or app.return_value == 0


def test_the_capacity_marker_of_a_plan_that_does_not_fit_is_said_in_the_legend():
    """A red ▏ stood in the bar of a plan above its device's capacity, explained nowhere."""
    from tests.wizard_helpers import GiB
    from tui.widgets.bars import PlanBar, stacked_bar

    bar = stacked_bar([(3 * GiB, "red"), (1 * GiB, "blue")], 2 * GiB, 40)
    assert bar.plain.index("▏") == 20  # 2 of 4 GiB: half way
    over = PlanBar({"weights": 3 * GiB, "activations": GiB}, capacity=2 * GiB)
    fits = PlanBar({"weights": GiB}, capacity=2 * GiB)
    assert "▏capacity 2.00 GiB" in over.render().plain.splitlines()[1]
    assert "▏" not in fits.render().plain


async def test_differs_most_says_it_is_by_bytes_with_the_difference_in_gib(tiny_model_dir, tmp_path):
    """"differs most: activations" was by GiB while the table beside it showed gradients −100 %: the line now says
    which measure it is by and gives the difference in GiB, and it names the line whose bytes differ most."""
    from tests.unit.test_snapshots import constructed_tracer
    from tests.wizard_helpers import text_of, wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    app.tracer = constructed_tracer
    async with app.run_test(size=(80, 24)) as pilot:
        await to_plan(pilot, app)
        await wait_for(pilot, lambda: app.state.traced is not None and app.screen.query(".traced-table"), 60)
        traced = app.state.traced
        rows = traced["lines"]
        by_bytes = max(rows, key=lambda k: abs(rows[k]["traced_bytes"] - rows[k]["analytic_bytes"]))
        assert traced["most_different"] == by_bytes
        diff = (rows[by_bytes]["traced_bytes"] - rows[by_bytes]["analytic_bytes"]) / 2**30
        line = text_of(app.screen._traced_slot)
        assert f"differs most from the analytic plan: {by_bytes} ({diff:+.2f} GiB traced − analytic: the largest " \
               "difference in bytes, not in per cent)" in line, line


# ------------------------------------------------------------------------------- the second walk (issue 17 note)
async def test_ctrl_n_on_an_invalid_setup_says_which_fields_are_at_fault(tiny_model_dir, tmp_path):
    """^n did nothing and said nothing on an invalid Setup, its footer still offering ^n Next."""
    from textual.widgets import Input

    from tests.wizard_helpers import wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        screen.query_one("#batch_size", Input).value = "0"
        await wait_for(pilot, lambda: screen.query_one("#next").disabled, 30)
        assert screen.check_action("next", ()) is None  # dimmed in the footer
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert isinstance(app.screen, SetupScreen)
        said = [str(n.message) for n in app._notifications]
        assert "fix what is marked ↑ first: Micro-batch / device" in said, said  # the field's label, as shown


async def test_ctrl_n_on_a_plan_that_does_not_fit_names_f_and_probe_anyway(tiny_model_dir, tmp_path):
    from textual.widgets import Button

    from tests.wizard_helpers import wait_for
    from tui.screens.plan import PlanScreen

    app = _small_host_app(tiny_model_dir, tmp_path, batch=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter", "ctrl+n")
        nxt = app.screen.query_one("#next", Button)
        await wait_for(pilot, lambda: str(nxt.label) == "p: Probe anyway →", 60)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert isinstance(app.screen, PlanScreen)
        said = [str(n.message) for n in app._notifications]
        assert ("^n probes only a plan that fits: f takes micro-batch 2, which fits; p (Probe anyway) measures "
                "this one") in said, said


async def test_while_a_stage_runs_esc_is_dimmed_and_says_why(tiny_model_dir, tmp_path):
    """The footer showed "esc Back" undimmed while the probe ran."""
    from tui.screens.stages import EvaluateScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")  # Setup: a screen to go back from
        await pilot.pause()
        assert app.check_action("back", ()) is True
        screen = EvaluateScreen()
        screen.run_stage = lambda: None  # no child: the stage is marked running as the screen starts it
        await app.push_screen(screen)
        await pilot.pause()
        assert app.state.running == "train_eval"
        assert app.check_action("back", ()) is None and screen.check_action("next", ()) is None
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen
        said = [str(n.message) for n in app._notifications]
        assert "the train + evaluate stage is running; q stops it and quits" in said, said


async def test_the_first_screen_does_not_offer_esc(tiny_model_dir, tmp_path):
    """Issue 51: "esc Back" was in Mode's footer and did nothing. The first screen does not offer it; the next does."""
    from tui.screens.mode import ModeScreen

    def offered(screen) -> list[str]:
        return [b.binding.key for b in screen.active_bindings.values()
                if b.binding.show and b.enabled and b.binding.action == "back"]

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert isinstance(app.screen, ModeScreen) and offered(app.screen) == []
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, ModeScreen)
        await pilot.press("enter")
        await pilot.pause()
        assert offered(app.screen) == ["escape"]


async def test_setup_shows_its_last_lines_when_tab_reaches_its_last_field(tiny_model_dir, tmp_path):
    """Issue 51: at 80×24 the Setup form's last line (the devices detected) could not be reached by Tab; and the
    evaluation size is a field (the wizard always evaluated 32 blocks)."""
    from textual.containers import VerticalScroll
    from textual.widgets import Input, Select

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        await pilot.pause()
        screen = app.screen
        assert screen.query_one("#eval_max_blocks", Input).value == "4"  # make_app's eval_max_blocks
        form = screen.query_one("#form", VerticalScroll)
        last = [w for w in form.query("Input, Select") if w.focusable][-1]
        assert isinstance(last, (Input, Select))
        last.focus()
        for _ in range(5):
            await pilot.pause()
        assert form.max_scroll_y > 0 and form.scroll_offset.y == form.max_scroll_y


async def test_a_config_read_into_setup_says_what_it_replaced_keeps_the_rest_and_lists_each_key(tiny_model_dir,
                                                                                                 tmp_path):
    """Issue 51: loading a config silently replaced earlier choices (mode dora → lora, steps 8 → 30), and Setup showed
    counts only where the dialog promised a per-key list."""
    from textual.widgets import Input

    from core.importers import build_spec, import_config
    from tests.paths import REPO
    from tui.screens.dialogs import ImportedKeys, LoadedConfig
    from tui.screens.setup import SetupScreen

    config = tmp_path / "trl.yaml"
    config.write_text((REPO / "tests" / "data" / "configs" / "trl_sft_qlora.yaml").read_text(encoding="utf-8")
                      .replace("MODEL", str(tiny_model_dir)), encoding="utf-8")
    app = make_app(tiny_model_dir, tmp_path, mode="dora", steps=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen.check_action("imported_keys", ()) is False  # nothing imported: ^k not offered
        app.screen._load_config(LoadedConfig(build_spec(config), import_config(config)))
        for _ in range(3):
            await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SetupScreen) and app.state.mode == "qlora"
        assert screen.query_one("#steps", Input).value == "8"  # the file sets no steps: Setup's stays
        note = str(screen.query_one("#imported").content)
        assert "replaced in Setup: mode dora → qlora" in note and "^r lists each key" in note
        assert screen.check_action("imported_keys", ()) is True
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert isinstance(app.screen, ImportedKeys)
        lines = app.screen.lines
        assert any(line.startswith("  used per_device_train_batch_size:") for line in lines), lines
        assert "kept from Setup (the file does not set them):" in lines and "  Training steps 8" in lines
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, SetupScreen)


async def test_setup_offers_quit_once_and_keeps_what_was_typed_across_back(tiny_model_dir, tmp_path):
    """With a dropdown focused the footer said "^q Quit ... q Quit"; Back and return turned "abc" into 4."""
    from textual.widgets import Input, Select

    from tests.wizard_helpers import text_of, wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        screen.query_one("#dtype", Select).focus()
        await pilot.pause()
        keys = [(b.binding.key, b.binding.description) for b in screen.active_bindings.values()
                if b.binding.show and b.enabled and b.binding.action.endswith(("quit_app", "quit_typed"))]
        assert keys == [("ctrl+q", "Quit")], keys
        screen.query_one("#batch_size", Input).value = "abc"
        await wait_for(pilot, lambda: "a whole number" in text_of(screen.query_one("#err-batch_size")), 30)
        await pilot.press("escape")
        await pilot.press("enter")
        assert isinstance(app.screen, SetupScreen)
        assert app.screen.query_one("#batch_size", Input).value == "abc"
        await wait_for(pilot, lambda: "a whole number" in text_of(app.screen.query_one("#err-batch_size")), 30)


async def test_setup_says_the_kill_step_and_what_waits_for_the_model(tiny_model_dir, tmp_path):
    """"boundary+1 · inside the next step" read as the step after the checkpoint; a too-long sequence showed no error
    while the model path was wrong, without saying it is checked once the model is found."""
    from textual.widgets import Input

    from core.spec import RunSpec
    from tests.wizard_helpers import text_of, wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora", resume_checkpoint_every=10, resume_kill_after_checkpoint=2,
                   steps=30)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        expected = RunSpec.build(mode="lora", steps=30, resume_checkpoint_every=10,
                                 resume_kill_after_checkpoint=2).resume.describe()
        assert "inside step 26" in expected
        assert text_of(screen.query_one("#kill-info")) == f"[dim]SIGKILL {expected}[/]"
        screen.query_one("#model", Input).value = str(tmp_path / "no-such-model")
        screen.query_one("#seq_len", Input).value = "100000"
        await wait_for(pilot, lambda: "not found" in text_of(screen.query_one("#err-model")), 30)
        assert ("(the sequence length and the LoRA targets are checked against the model once it is found)"
                in text_of(screen.query_one("#err-model")))


async def test_path_fields_are_edited_not_replaced_by_the_first_key(tiny_model_dir, tmp_path):
    """Typing q in the Model field turned "smollm2-135m" into "q"."""
    from textual.widgets import Input

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        model = app.screen.query_one("#model", Input)
        assert app.screen.focused is model
        await pilot.press("x")
        assert model.value == f"{tiny_model_dir}x"
        assert app.screen.query_one("#batch_size", Input).select_on_focus  # a number is replaced


async def test_the_probe_screen_says_the_capacity_the_plan_was_judged_by(tiny_model_dir, tmp_path):
    """Plan "of 22.20 GiB available", probe bar "of 23.54 GiB total": the probe screen now names both."""
    from core.prerun import make_plan
    from core.spec import RunSpec
    from tests.wizard_helpers import TEST_HOST
    from tui.screens.stages import capacity_note

    ctx = make_plan(RunSpec.build(mode="lora", model=str(tiny_model_dir), seq_len=64), [TEST_HOST])
    d = ctx.plan.devices[0]
    assert capacity_note(ctx) == (f"[dim]the bars are each device's total memory; the plan was judged by: cpu plan "
                                  f"{d.total_bytes / 2**30:.2f} GiB of 64.00 GiB (constructed for tests)[/]")


def test_the_quiz_labels_choices_by_their_keys_and_spreads_the_right_answers(lora_record):
    """The header said "Keys 1-4" over choices labelled A-D; A was the answer to 4 of 6 questions."""
    import collections
    import copy

    from core.quiz import build_quiz
    from tui.screens.quiz import LETTERS

    assert LETTERS == "1234"
    record = copy.deepcopy(lora_record)
    for salt in ("", "a", "b", "c"):
        record["spec"]["hash"] = (record["spec"]["hash"][:-1] + salt) if salt else record["spec"]["hash"]
        questions = build_quiz(record)
        counts = collections.Counter(q.answer for q in questions)
        assert max(counts.values()) <= -(-len(questions) // 4), counts  # no position right more than ⌈n/4⌉ times
        for q in questions:
            assert len(set(q.choices)) == len(q.choices) and 0 <= q.answer < len(q.choices)


def test_the_quiz_has_no_host_ram_choice_for_a_cpu_device(lora_record):
    from core.quiz import build_quiz

    record = lora_record
    fit = next(q for q in build_quiz(record) if q.id == "fit_by_device")
    assert record["plan"]["devices"][0]["name"] == "cpu"
    assert not any("host's RAM added" in c for c in fit.choices), fit.choices
    source = record["plan"]["devices"][0]["capacity_source"]
    assert source and f"({source})" in fit.prompt, fit.prompt


def test_the_terms_say_the_moments_are_in_the_parameters_dtype():
    from tui.screens.dialogs import TERMS

    assert "two fp32 moments" not in TERMS and "in that parameter's dtype" in TERMS


async def test_a_check_that_answers_after_setup_was_closed_draws_nothing(tiny_model_dir, tmp_path):
    """Found in a fresh clone's CI run: Esc from Setup while the model and data check ran, then its answer arrived
    and drew on the closed screen (NoMatches '#form-error' in the worker, a failed test)."""
    from tests.wizard_helpers import wait_for
    from tui.screens.mode import ModeScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter")
        screen = app.screen
        await wait_for(pilot, lambda: screen._checked is not None, 30)
        answer = screen._checked
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, ModeScreen)
        screen._inputs_checked(screen._draft, answer)  # the late answer: it raised NoMatches before
        assert screen._checked is answer and not screen.query("#form-error")  # kept, with nothing to draw on


async def test_the_plan_screen_shows_what_a_gpu_will_count_side_by_side(tiny_model_dir, tmp_path):
    """Issue 38: on a CUDA device the traced plan's steady-state step is shown as peak allocated, peak reserved (the
    caching allocator's replay) and NVML used, each with its method, the slack line by line, the expandable-segments
    what-if; the fit line says it is judged on the predicted NVML used."""
    from core.plan.devices import DeviceInfo
    from core.plan.traced import TracedPlan, compare, comparison_json, predict_reserved
    from tests.wizard_helpers import GiB, text_of, wait_for

    def tracer(spec, ctx, cancelled=None) -> dict:
        device = ctx.plan.devices[0]
        parts = {k: device.lines[k].bytes for k in ("weights", "optimizer_states", "activations", "temporaries")}
        events = [("alloc", k, n) for k, n in parts.items() if n] + [("mark", "step 1", 0), ("mark", "step 2", 0)]
        traced = TracedPlan(components={**parts, "gradients": 0, "kv_cache": 0}, peak_bytes=sum(parts.values()),
                            categories={}, method="constructed", seconds=0.1, tensors="fake",
                            reserved=predict_reserved(events, ""))
        return comparison_json(traced, compare(device, traced), device.device.name)

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    app.tracer = tracer
    app.state.devices_override = [DeviceInfo("cuda:0", "cuda", "NVIDIA H200", 140 * GiB, "constructed for tests")]
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter", "ctrl+n")  # a GPU planned, not here: Next stays off (planned, not runnable)
        await wait_for(pilot, lambda: len(app.screen.query(".traced-table")) == 2, 60)
        memory = app.state.traced["device_memory"]
        table = app.screen.query(".traced-table")[1]
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        assert [r[0] for r in rows[:3]] == ["peak allocated", "peak reserved", "NVML used"]
        assert rows[1][1] == f"{memory['reserved_bytes'] / 2**30:.3f}" and "caching allocator" in rows[1][2]
        assert [r[0] for r in rows[3:]] == ["  slack"] * 3
        shown = " ".join(text_of(w) for w in app.screen.query("Static"))
        assert "expandable_segments:True" in shown and "judged by the predicted NVML used" in shown


def test_the_reference_numbers_the_mode_entries_as_the_screen_does():
    """Issue 51: docs/reference.md said "5 Your own command" and "1-5" while the screen had 6 entries."""
    from tests.paths import REPO
    from tui.screens.mode import MODES

    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    n = len(MODES)
    assert f"**{n} {MODES['command'][0]}**" in text and f"1-{n} choose" in text
