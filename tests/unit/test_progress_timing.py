"""The end-of-run line on where step time went (dstune.progress.time_split_text, fed by the loop's timings)."""

from dstune.progress import time_split_text


def test_reports_data_wait_as_time_and_fraction_of_step_time():
    text = time_split_text({"data_s": 0.5, "compute_s": 49.5})
    assert text.startswith("waiting for data 0.5 s (1.0% of step time), compute 49.5 s")
    assert "bottleneck" not in text


def test_names_the_loader_as_the_bottleneck_with_what_helps():
    text = time_split_text({"data_s": 30.0, "compute_s": 70.0})
    assert "(30.0% of step time)" in text
    assert "the loader is a bottleneck" in text and "data.num_workers" in text and "data.cache" in text


def test_a_cached_run_is_not_told_to_turn_on_the_cache():
    text = time_split_text({"data_s": 30.0, "compute_s": 70.0}, cached=True)
    assert "the loader is a bottleneck" in text and "data.num_workers" in text and "data.cache.dir" in text
    assert "turn on data.cache" not in text


def test_no_steps_is_not_a_division_by_zero():
    assert "(0.0% of step time)" in time_split_text({"data_s": 0.0, "compute_s": 0.0})


def test_eta_after_a_resume_comes_from_the_steps_since_the_resume(monkeypatch):
    """A run resumed at step 90 of 100: 2 steps in 10 s since the resume means 8 more steps take 40 s, not the
    2 s that 92 'done' steps in 10 s would suggest."""
    import dstune.progress as progress

    clock = [1000.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    display = progress.ProgressDisplay(enabled=False, total_steps=100, total_epochs=1.0, start_step=90)
    clock[0] += 10.0
    assert display.timing_text(92) == "elapsed 10.0 s  eta 40.0 s"
    assert display.timing_text(90) == "elapsed 10.0 s  eta -"  # no step since the resume yet: no guess


def test_a_long_count_shows_progress_on_stderr_only_after_a_moment(monkeypatch, capsys):
    import dstune.progress as progress

    clock = [50.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    count = progress.CountProgress("data.path: checked", "images", 300, after_s=2.0, every_s=5.0)
    count.update(10)
    clock[0] += 1.0
    count.update(20)  # under a moment: nothing
    assert capsys.readouterr() == ("", "")
    clock[0] += 1.5
    count.update(100)
    clock[0] += 1.0
    count.update(150)  # within every_s of the last line
    clock[0] += 0.5
    count.update(300)  # done: always said once progress was shown
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "data.path: checked 100 of 300 images (2 s)",
        "data.path: checked 300 of 300 images (4 s)",
    ]
