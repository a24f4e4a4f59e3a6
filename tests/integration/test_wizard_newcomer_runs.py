"""Issue 17: the wizard as a newcomer meets it, the walks that start a child process (the probe, training, or the plan
screen's traced plan); the rest are in tests/unit/test_wizard_newcomer.py."""

from __future__ import annotations

from tests.unit.test_wizard_newcomer import _small_host_app, to_plan
from tests.wizard_helpers import make_app


async def test_probe_anyway_probes_and_the_plan_stage_still_fails(tiny_model_dir, tmp_path):
    from textual.widgets import Button

    from tests.wizard_helpers import wait_for
    from tui.screens.plan import PlanScreen
    from tui.screens.stages import ProbeScreen

    app = _small_host_app(tiny_model_dir, tmp_path, batch=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter", "ctrl+n")
        assert isinstance(app.screen, PlanScreen)
        nxt = app.screen.query_one("#next", Button)
        await wait_for(pilot, lambda: str(nxt.label) == "p: Probe anyway →", 60)
        await pilot.click("#next")
        assert isinstance(app.screen, ProbeScreen)
        assert app.screen.check_action("next", ()) is None  # ^n dimmed while the probe runs
        await wait_for(pilot, lambda: app.state.running is None and app.state.run is not None
                       and "probe" in app.state.run.results)
        assert app.state.run.probe_unfit and not app.state.run.plan_fits
        assert app.screen.check_action("next", ()) is True


async def test_every_footer_key_is_on_screen_at_80_columns(tiny_model_dir, tmp_path):
    """The footer was cut ("? Ter") on the plan screen."""
    from textual.widgets._footer import FooterKey, FooterLabel

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await to_plan(pilot, app)
        from tests.wizard_helpers import wait_for

        def laid_out() -> list:  # under load the footer is drawn a while after the screen (no fixed pause)
            found = list(app.screen.query(FooterKey)) + list(app.screen.query(FooterLabel))
            return found if found and all(k.region.width > 0 for k in found) else []

        await wait_for(pilot, lambda: bool(laid_out()), 30)
        keys = laid_out()
        assert keys and all(k.region.right <= 80 and k.region.width > 0 for k in keys), [
            (str(k.render()), k.region) for k in keys]
        assert any("Terms" in str(k.render()) for k in keys)


async def test_the_plan_says_how_each_line_is_estimated_in_full_at_80_columns(tiny_model_dir, tmp_path):
    """The plan's method column was cut at 80 columns; now it wraps."""
    from tests.wizard_helpers import wait_for
    from tui.screens.plan import PlanScreen

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("enter", "ctrl+n")
        assert isinstance(app.screen, PlanScreen)
        # under load the table is laid out a while after it is mounted: wait for its region, not a fixed pause
        await wait_for(pilot, lambda: bool(app.screen.query(".methods"))
                       and app.screen.query_one(".methods").region.width > 0, 60)
        methods = app.screen.query_one(".methods")
        shown = " ".join(line.text for line in methods.render_lines(methods.region.reset_offset)).split()
        plan = app.state.ctx.plan.devices[0]
        for line in plan.lines.values():  # every word of every method is on screen, none cut
            assert " ".join(line.method.split()) in " ".join(shown), line.method
        assert methods.region.right <= 80


def test_the_evaluation_time_is_said_apart_from_the_model_load(lora_run):
    """"perplexity before ... 56.2 s" read as if it held the model load. The load is said on its own line, before."""
    from core.events import Message

    _, record, events = lora_run
    texts = [e.text for e in events if isinstance(e, Message) and e.stage == "train_eval"]
    built = next(i for i, t in enumerate(texts) if t.startswith("model built in "))
    before = next(i for i, t in enumerate(texts) if t.startswith("held-out perplexity before training"))
    assert built < before and "s of evaluation)" in texts[before]
    seconds = record["evaluation"]["before"]["seconds"]
    assert f"{seconds:.1f} s of evaluation" in texts[before]
    from core.events import Evaluated

    evaluated = {e.when: e.perplexity for e in events if isinstance(e, Evaluated)}
    assert evaluated == {"before": record["evaluation"]["before"]["perplexity"],
                         "after": record["evaluation"]["after"]["perplexity"]}


async def test_what_if_keys_show_the_new_total_at_the_top(tiny_model_dir, tmp_path):
    """After b/B/s/S the view jumped and the new total scrolled away."""
    from tests.wizard_helpers import wait_for

    app = make_app(tiny_model_dir, tmp_path, mode="lora")
    async with app.run_test(size=(80, 24)) as pilot:
        await to_plan(pilot, app)
        body = app.screen.query_one("#plan-body")
        body.scroll_end(animate=False)
        await pilot.pause(0.2)
        assert body.scroll_y > 0
        await pilot.press("b")
        await wait_for(pilot, lambda: app.state.spec.batch_size == 2 and not app.screen.query_one("#next").disabled,
                       60)
        await pilot.pause(0.2)
        assert body.scroll_y == 0


async def test_a_finished_probe_revisited_says_every_peak_with_its_name(tiny_model_dir, tmp_path):
    """Revisited, the bar said "others N/A"; its peak, the tracked tensors' and the process's RSS were three unnamed
    peaks; and the CPU's overhead line said "in peak" though the tensor peak holds no runtime."""
    from core.monitor.sampler import HostBackend
    from tests.wizard_helpers import TEST_HOST, text_of, wait_for
    from tui.app import GpuAcceptApp
    from tui.screens.plan import PlanScreen
    from tui.screens.stages import ProbeScreen

    app = GpuAcceptApp(runs_root=tmp_path, backend=HostBackend(), devices_override=[TEST_HOST], mode="lora",
                       fields={"model": str(tiny_model_dir), "seq_len": 64, "steps": 6, "eval_max_blocks": 4,
                               "resume_checkpoint_every": 2, "resume_kill_after_checkpoint": 1})
    async with app.run_test(size=(80, 24)) as pilot:
        await to_plan(pilot, app)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.state.running is None and app.state.run is not None
                       and "probe" in app.state.run.results, 120)
        await pilot.press("escape")
        assert isinstance(app.screen, PlanScreen)
        await pilot.press("ctrl+n")  # the plan is unchanged: a new probe screen shows the probe that ran
        screen = app.screen
        assert isinstance(screen, ProbeScreen)
        await wait_for(pilot, lambda: screen._bars, 10)
        await pilot.pause(0.5)
        bar = next(iter(screen._bars.values()))
        line = bar.render().plain.splitlines()[1]
        assert "probe ended (peak " in line and "others N/A" not in line, line
        assert bar.others is not None and bar.others > 0
        title = text_of(screen.query_one("#measured-title"))
        assert "peak of live tensors" in title and "(tracked in the step)" in title and "high-water mark" in title
        table = screen.query_one("#measured")
        rows = {str(table.get_row_at(i)[0]): [str(c) for c in table.get_row_at(i)] for i in range(table.row_count)}
        probe = app.state.run.results["probe"]
        d, c = probe.devices[0], probe.comparisons[0]
        assert rows["cpu process vs peak RSS"][2] == f"{d.peak_rss_bytes / 2**30:.2f} GiB"
        if d.peak_rss_bytes >= d.peak_bytes:  # the runtime measured as RSS minus tensors, beside its plan line
            assert c.components["overhead"][1] == d.peak_rss_bytes - d.peak_bytes
            assert rows["cpu overhead"][2] == f"{(d.peak_rss_bytes - d.peak_bytes) / 2**30:.2f} GiB"
        assert rows["cpu activations"][2] == "in peak"
        assert "cpu kv_cache" not in rows  # training keeps no KV cache

