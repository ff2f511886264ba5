"""``autopart profile``: writes a loadable profile, shows a table, fails with one line."""

from __future__ import annotations

import json
import os

import pytest

from autopart.schema import Profile
from cli.cmd_profile import default_filename
from cli.main import main

FAST = ["--seq-len", "16", "--repeats", "1", "--warmup", "0"]


def test_writes_the_default_file_in_the_cwd(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "tiny-llama", *FAST]) == 0
    profile = Profile.load(tmp_path / "tiny-llama.cpu.profile.json")
    assert len(profile.blocks) == 3 + 4 * 4 and profile.setup.granularity == "projection"
    out, err = capsys.readouterr()
    assert "model.layers.0" in out and "total" in out and "measured" in out
    assert "tiny-llama.cpu.profile.json" in err


def test_json_output_and_explicit_path(tmp_path, capsys):
    path = tmp_path / "sub" / "p.json"
    assert main(["profile", "tiny-llama", "--backend", "analytical:h200", "--json",
                 "--out", str(path), "--seq-len", "32", "--dtype", "bfloat16"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(path.read_text())
    assert printed["setup"]["backend"] == "analytical:h200"
    assert printed["setup"]["dtype"] == "bfloat16"


def test_user_error_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["profile", "tiny-llama", "--micro-batch-size", "0", "--out",
                 str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "micro_batch_size must be an integer >= 1, got 0" in err
    assert not (tmp_path / "x.json").exists()


def test_unknown_model_is_exit_2(capsys):
    assert main(["profile", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_default_filename_is_path_safe():
    profile = Profile.from_json(_tiny_json())
    assert default_filename(profile) == "org-name.analytical-h100.profile.json"


def _tiny_json() -> str:
    from autopart.intake import load_model
    from autopart.profile import profile_model

    loaded = load_model("tiny-llama", name="org/name")
    return profile_model(loaded, backend="analytical:h100", seq_len=8).to_json()


def test_pp_sets_rank_threads_and_records_the_machine_check(tmp_path, monkeypatch, capsys,
                                                            one_thread):
    """--pp N profiles at cores / N threads and takes the cached check for that count."""
    from autopart.schema import RuntimeOverhead
    from autopart.verify import save_cached_overhead

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    threads = max(1, (os.cpu_count() or 1) // 2)
    check = RuntimeOverhead(fwd_action_ms=0.1, bwd_action_ms=0.2, p2p_ms=0.05, step_ms=1.0,
                            link_latency_ms=0.08, link_bandwidth_bytes_per_s=2e9,
                            backend="gloo", num_threads=threads)
    save_cached_overhead(check)
    out_path = tmp_path / "p.json"
    assert main(["profile", "tiny-llama", "--pp", "2", "--neighbours", "0", *FAST,
                 "--no-rehearsal", "--out", str(out_path)]) == 0
    profile = Profile.load(out_path)
    assert profile.setup.num_threads == threads
    assert profile.setup.neighbours == 0
    assert profile.runtime_overhead == check
    assert not profile.calibration
    assert "runtime overhead (machine check" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_pp_rehearses_the_even_split_and_folds_it_in(tmp_path, monkeypatch, capsys,
                                                     one_thread):
    """--pp 2 on CPU runs the even split on 2 local ranks under 1F1B, Interleaved 1F1B,
    GPipe, 1F1B and Interleaved 1F1B again (each in two launches pooled, or the two
    fastest of three; 1F1B and Interleaved a third time where their two runs disagree) and
    folds them in: planning any of them
    again predicts the step that ran (1F1B's: the geometric mean of the two fastest
    runs)."""
    import autopart.solve
    from autopart.schema import RuntimeOverhead
    from autopart.solve import make_plan, plan_again
    from autopart.verify import save_cached_overhead

    rehearsed = []  # the rehearsal's plans: 1F1B, Interleaved 1F1B, GPipe (even splits)

    def spy(*args, **kwargs):
        rehearsed.append(make_plan(*args, **kwargs))
        return rehearsed[-1]

    monkeypatch.setattr(autopart.solve, "make_plan", spy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    threads = max(1, (os.cpu_count() or 1) // 2)
    check = RuntimeOverhead(fwd_action_ms=0.01, bwd_action_ms=0.01, p2p_ms=0.0001,
                            step_ms=0.0, link_latency_ms=0.01, link_bandwidth_bytes_per_s=2e9,
                            backend="gloo", num_threads=threads, runtime_p2p_ms=0.2)
    save_cached_overhead(check)
    out_path = tmp_path / "p.json"
    assert main(["profile", "tiny-llama", "--pp", "2", "--neighbours", "0", *FAST,
                 "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    profile = Profile.load(out_path)
    record = profile.calibration
    assert record["source"].startswith("rehearsal: even split, 1F1B, m 4")
    assert "then rehearsed (even split" in profile.setup.time_source
    assert "rehearsal (even split, 1F1B, m 4" in out and "geometric mean): stage 0 F x" in out
    assert len(record["factors"]) == 2 and record["post"]["field"] == "p2p_ms"
    assert profile.runtime_overhead.p2p_ms == record["post"]["after_ms"]
    # each kind's run: two launches pooled, or a third where they disagreed and the two
    # fastest pooled; the 1F1B split runs first and last (a third time where the two
    # disagreed), and the geometric mean of the two fastest is folded in
    def kept(launches):
        assert len(launches) in (2, 3)
        fastest = sorted(launches)[:2]
        return (fastest[0] * fastest[1]) ** 0.5

    runs = sorted(kept(record[key]) for key in ("launches_ms", "again_launches_ms",
                                                "third_launches_ms") if key in record)
    if len(runs) == 3:
        assert "three times" in record["source"] and "the two fastest" in out
        runs = runs[:2]
    else:
        assert "twice" in record["source"] and "their geometric mean" in out
    assert record["measured_step_ms"] == pytest.approx((runs[0] * runs[1]) ** 0.5, rel=1e-4)
    assert ", then " in out
    assert record["post"]["run_step_ms"] == pytest.approx(record["measured_step_ms"], abs=1e-3)
    # the record says the step the fitted prices predict: the run's, or above it where a
    # run on a host's slow spell was faster than its stages' medians add up to (free posts)
    # the same splits replanned (``make_plan`` on the calibrated blocks may pick another
    # granularity for an even split: under CI load it read 1.1% off)
    assert [p.schedule for p in rehearsed] == ["1f1b", "interleaved-1f1b", "gpipe"]
    even = plan_again(profile, rehearsed[0])
    assert even.predicted_step_ms == pytest.approx(record["post"]["predicted_step_ms"],
                                                   rel=0.01)
    assert record["post"]["predicted_step_ms"] >= 0.999 * record["measured_step_ms"]
    runtime = record["runtime_post"]
    assert runtime["field"] == "runtime_p2p_ms" and "interleaved 1F1B (v 2) measured" in out
    # the Interleaved split ran twice (three times where they disagreed), pooled as 1F1B's
    runtime_runs = sorted(kept(runtime[key]) for key in ("launches_ms", "again_launches_ms",
                                                         "third_launches_ms") if key in runtime)
    assert len(runtime_runs) in (2, 3)
    assert runtime["run_step_ms"] == pytest.approx(
        (runtime_runs[0] * runtime_runs[1]) ** 0.5, rel=1e-3)
    assert profile.runtime_overhead.runtime_p2p_ms == runtime["after_ms"]
    interleaved = plan_again(profile, rehearsed[1])
    assert interleaved.predicted_step_ms == pytest.approx(runtime["predicted_step_ms"],
                                                          rel=0.01)
    assert runtime["predicted_step_ms"] >= 0.999 * runtime["run_step_ms"]
    gpipe = record["gpipe_post"]
    assert gpipe["field"] == "gpipe_p2p_ms" and "GPipe (m 8) measured" in out
    assert profile.runtime_overhead.gpipe_p2p_ms == gpipe["after_ms"] > 0
    waits = plan_again(profile, rehearsed[2])
    assert waits.predicted_step_ms == pytest.approx(gpipe["predicted_step_ms"], rel=0.01)


@pytest.mark.parametrize(("steps", "pooled"), [((54.8, 45.3, 44.0), (45.3, 44.0)),
                                              ((688.7, 609.9, 664.3), (609.9, 664.3)),
                                              ((40.0, 52.0, 50.0), (40.0, 50.0)),
                                              ((51.0, 50.0), (51.0, 50.0))])
def test_the_rehearsal_pools_the_two_fastest_runs(steps, pooled):
    """Two 1F1B runs are pooled; of three (the first two disagreed), the two fastest in
    the order they ran: load only slows a run, so the slowest is dropped rather than
    averaged in, also where a slow spell took two of them (r21's heavy-head Llama)."""
    from types import SimpleNamespace

    from autopart.verify.rehearse import _fastest_two

    runs = [(SimpleNamespace(measured_step_ms=ms), ()) for ms in steps]
    assert tuple(run.measured_step_ms for run, _ in _fastest_two(runs)) == pooled


def test_no_machine_check_says_how_to_run_one(tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["profile", "tiny-llama", *FAST, "--threads", "1",
                 "--out", str(tmp_path / "p.json")]) == 0
    assert Profile.load(tmp_path / "p.json").runtime_overhead is None
    assert "autopart calibrate --machine --threads 1" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "expected"), [
    (["--pp", "3"], 2), (["--pp", "1"], 0), ([], 0), (["--pp", "4", "--neighbours", "1"], 1),
    (["--pp", "2", "--backend", "analytical:h100"], 0)])
def test_pp_n_measures_with_n_minus_1_busy_neighbours_on_cpu(argv, expected):
    import argparse

    from cli import cmd_profile

    parser = argparse.ArgumentParser()
    cmd_profile.add_parser(parser.add_subparsers())
    args = parser.parse_args(["profile", "m", *argv])
    assert cmd_profile._neighbours(args) == expected


@pytest.mark.parametrize("argv", [["--neighbours", "-1"],
                                  ["--neighbours", "1", "--backend", "analytical:h100"]])
def test_bad_neighbours_is_one_line_and_exit_2(argv, capsys):
    assert main(["profile", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "--neighbours" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(("argv", "expected"), [([], "auto"), (["--cache-flush", "llc"], "llc"),
                                                (["--cache-flush", "none"], "none"),
                                                (["--cache-flush", "model"], "model"),
                                                (["--cache-flush", "order"], "order")])
def test_cache_flush_flag_reaches_the_options(argv, expected):
    import argparse

    from cli import cmd_profile

    parser = argparse.ArgumentParser()
    cmd_profile.add_parser(parser.add_subparsers())
    args = parser.parse_args(["profile", "m", *argv])
    assert cmd_profile.profile_options(args).cache_flush == expected


def test_clock_flag_reaches_the_options():
    import argparse

    from cli import cmd_profile

    parser = argparse.ArgumentParser()
    cmd_profile.add_parser(parser.add_subparsers())
    assert cmd_profile.profile_options(parser.parse_args(["profile", "m"])).clock == "auto"
    args = parser.parse_args(["profile", "m", "--clock", "thread"])
    assert cmd_profile.profile_options(args).clock == "thread"
