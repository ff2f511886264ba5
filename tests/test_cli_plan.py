"""``autopart plan`` / ``autopart simulate``: tables, exports, files, and one-line errors.

Each error case checks exit code 2, a single stderr line naming the problem and
the remedy, and that no file was written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from solve_helpers import GIB, llama_like

from autopart.errors import AutopartError
from autopart.schema import Plan
from cli.main import main


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "llama.profile.json"
    path.write_text(llama_like(8, head_ms=6.0).to_json())
    return path


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_plan_table_shows_cuts_and_baselines(profile_path, tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    assert main(["plan", str(profile_path), "--pp", "4", "--schedule", "1f1b",
                 "--microbatches", "8", "--out", str(out_path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(out_path)
    assert "pipeline_cuts = " + json.dumps(list(plan.pipeline_cuts)) in out
    assert "vs even" in out and "predicted step" in out
    assert len(plan.pipeline_cuts) == 3


def test_plan_json_is_deterministic(profile_path, capsys):
    args = ["plan", str(profile_path), "--pp", "2", "--format", "json", "--microbatches", "4"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize("fmt", ["nxd", "nemo", "torchtitan", "megatron"])
def test_exports(profile_path, capsys, fmt):
    assert main(["plan", str(profile_path), "--pp", "2", "--microbatches", "4",
                 "--schedule", "1f1b", "--format", fmt]) == 0
    out = capsys.readouterr().out
    marker = {"nxd": "pipeline_cuts = [", "nemo": "module_fqns_per_model_part",
              "torchtitan": "pipeline_parallel_degree",
              "megatron": "--pipeline-model-parallel-layout"}
    assert marker[fmt] in out


def test_simulate_replays_the_plan(profile_path, tmp_path, capsys):
    plan_path, trace_path = tmp_path / "p.json", tmp_path / "t.json"
    assert main(["plan", str(profile_path), "--pp", "2", "--microbatches", "4",
                 "--out", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(plan_path), "--trace", str(trace_path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(plan_path)
    assert f"step {plan.predicted_step_ms:.3f} ms" in out
    assert json.loads(trace_path.read_text())["traceEvents"]


def test_pp_larger_than_blocks(profile_path, capsys):
    assert main(["plan", str(profile_path), "--pp", "64"]) == 2
    err = _one_line_error(capsys)
    assert "pp_size (64) exceeds the number of blocks of" in err
    assert "(11: layer, head whole); lower --pp to at most 11" in err


def test_infeasible_memory_names_what_fits(profile_path, tmp_path, capsys):
    out_path = tmp_path / "never.json"
    assert main(["plan", str(profile_path), "--pp", "2", "--memory-limit", "1MiB",
                 "--out", str(out_path)]) == 2
    err = _one_line_error(capsys)
    assert "the smallest limit that fits is" in err and "MiB, " in err
    assert not out_path.exists()


@pytest.mark.parametrize(("content", "message"), [
    ("{broken", "not valid JSON"),
    ('{"schema_version": 1}', "missing key"),
])
def test_malformed_profile(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["plan", str(path), "--pp", "2"]) == 2
    assert message in _one_line_error(capsys)


def test_bad_memory_limit_and_virtual_stages(profile_path, capsys):
    assert main(["plan", str(profile_path), "--pp", "2", "--memory-limit", "lots"]) == 2
    assert "--memory-limit 'lots' is not a size" in _one_line_error(capsys)
    assert main(["plan", str(profile_path), "--pp", "2", "--virtual-stages", "two"]) == 2
    assert "--virtual-stages must be auto or a positive integer" in _one_line_error(capsys)


def test_missing_plan_file_for_simulate(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in _one_line_error(capsys)


@pytest.mark.slow  # a fresh interpreter imports torch: about 5 s on a loaded CPU
def test_debug_shows_the_traceback(tmp_path):
    """--debug trades the one-line error for the full traceback."""
    result = subprocess.run([sys.executable, "-m", "autopart", "--debug", "simulate",
                             str(tmp_path / "nope.json")], capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.parametrize("argv", [["--debug", "-v", "simulate", "PLAN"],
                                  ["simulate", "PLAN", "--debug", "-v"]])
def test_debug_and_verbose_go_before_or_after_the_command(tmp_path, argv):
    """The one-line errors say "rerun with --debug -v": after the command as well."""
    argv = [str(tmp_path / "nope.json") if a == "PLAN" else a for a in argv]
    with pytest.raises(AutopartError, match="does not exist"):
        main(argv)
    assert main(["simulate", str(tmp_path / "nope.json")]) == 2  # without: one line


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan"])
    assert exc.value.code == 2
    err = _one_line_error(capsys)
    assert "required: profile" in err and "autopart plan --help" in err


def test_nxd_with_few_layer_boundaries_plans_instead_of_crashing(tmp_path, capsys):
    """Two layers give three NxD units: pp 2 plans (v=2 skipped), pp 4 is one clear error."""
    path = tmp_path / "two_layers.json"
    path.write_text(llama_like(2).to_json())
    assert main(["plan", str(path), "--pp", "2", "--format", "nxd"]) == 0
    assert "pipeline_cuts = [" in capsys.readouterr().out
    assert main(["plan", str(path), "--pp", "4", "--format", "nxd"]) == 2
    assert "lower --pp" in _one_line_error(capsys)


def test_infeasible_baseline_points_to_the_optimal_partition(tmp_path, capsys):
    """Just under the even split's rank-0 peak, only the requested baseline breaks the limit."""
    path = tmp_path / "heavy_act.json"
    path.write_text(llama_like(8, act_bytes=GIB).to_json())
    args = ["plan", str(path), "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"]
    assert main([*args, "--partition", "even", "--format", "json"]) == 0
    even_peak = max(r["peak_memory_bytes"] for r in json.loads(capsys.readouterr().out)["ranks"])
    limit = str(even_peak - 1)
    assert main([*args, "--partition", "even", "--memory-limit", limit]) == 2
    assert "use --partition optimal" in _one_line_error(capsys)
    assert main([*args, "--memory-limit", limit, "--out", str(tmp_path / "p.json")]) == 0


@pytest.mark.parametrize(("precision", "per_param"), [(None, 16), ("bf16-mixed", 18)])
def test_plan_precision_sets_static_bytes(profile_path, tmp_path, capsys, precision,
                                          per_param):
    """The fp32 profile defaults to fp32 (16 B/param); a preset changes every stage's static."""
    out_path = tmp_path / "plan.json"
    extra = [] if precision is None else ["--precision", precision]
    assert main(["plan", str(profile_path), "--pp", "2", "--microbatches", "4",
                 "--schedule", "1f1b", "--out", str(out_path), *extra]) == 0
    assert f"{per_param} B per parameter" in capsys.readouterr().out
    plan = Plan.load(out_path)
    assert all(s.static_bytes == per_param * s.param_count for s in plan.stages)


def test_json_on_stdout_is_only_the_plan_when_the_ilp_runs(tmp_path):
    """highspy prints a banner from C++ when it is constructed; ``--format json`` piped to
    another program must still be the plan alone (a fresh process, so fd 1 is a pipe)."""
    pytest.importorskip("highspy")
    path = tmp_path / "p.json"
    llama_like(6).save(str(path))
    result = subprocess.run(
        [sys.executable, "-c", "from autopart.cli.main import main; raise SystemExit(main())",
         "plan", str(path), "--pp", "2", "--schedule", "interleaved-1f1b",
         "--virtual-stages", "2", "--microbatches", "4", "--solver", "ilp", "--format", "json"],
        capture_output=True, text=True, check=True, timeout=120, cwd=tmp_path)
    assert json.loads(result.stdout)["solver"]["name"] == "ilp"


def _cli_plan(args: list[str], tmp_path, capsys) -> str:
    out = tmp_path / "cli.plan.json"
    assert main(["plan", *args, "--out", str(out)]) == 0
    capsys.readouterr()
    return out.read_text()


def test_one_planning_entry_gives_byte_identical_plans(profile_path, tmp_path, capsys):
    """The CLI, ``make_plan`` (keywords or ``PlanOptions``), ``plan_mesh`` and the options
    ``auto_pipeline(plan="auto")`` resolves for its groups all plan the same bytes from the
    same inputs: the memory limit and links default from the profile's device in each."""
    from autopart.runtime.groups import Groups
    from autopart.runtime.plan_source import AutoOptions
    from autopart.schema import Profile
    from autopart.solve import PlanOptions, make_plan, plan_mesh

    profile = Profile.load(profile_path)
    cli = _cli_plan([str(profile_path), "--pp", "4", "--microbatches", "8"], tmp_path, capsys)
    assert make_plan(profile, pp_size=4, num_microbatches=8).to_json() == cli
    assert make_plan(profile, PlanOptions(pp_size=4, num_microbatches=8)).to_json() == cli
    groups = Groups(pp_group=None, pp_rank=0, pp_size=4, pp_global_ranks=(0, 1, 2, 3))
    _, options = AutoOptions(plan={"num_microbatches": 8}).resolved(groups, "cpu",
                                                                     custom_loss=False)
    assert make_plan(profile, options).to_json() == cli

    mesh = _cli_plan([str(profile_path), "--devices", "4", "--device", "h100",
                      "--global-batch-size", "16"], tmp_path, capsys)
    assert plan_mesh(profile, devices=4, device="h100",
                     global_batch_size=16).plan.to_json() == mesh
    # The device's memory limit is in force by default, not unlimited.
    assert json.loads(mesh)["setup"]["memory_limit_bytes"] is not None
