"""Every path a user gives the CLI fails in one line (exit 2), before any work is done.

Unwritable outputs: a folder that cannot be created (under a regular file), and a
directory given as a file. Unreadable inputs: missing, a directory, binary.
"""

from __future__ import annotations

import pytest

from cli.main import main


@pytest.fixture()
def paths(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(128, 256)))
    return {"blocked": str(blocker / "sub" / "out.json"), "dir": str(tmp_path),
            "missing": str(tmp_path / "missing.json"), "binary": str(binary)}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


OUTPUTS = [
    ["profile", "tiny-llama", "--out", "{}"],
    ["plan", "{missing}", "--pp", "2", "--out", "{}"],
    ["plan", "{missing}", "--pp", "2", "--trace", "{}"],
    ["simulate", "{missing}", "--trace", "{}"],
    ["verify", "{missing}", "--model", "tiny-llama", "--json", "{}"],
    ["verify", "{missing}", "--model", "tiny-llama", "--trace", "{}"],
    ["verify", "{missing}", "--model", "tiny-llama", "--profile", "{missing}",
     "--calibrated-profile", "{}"],
    ["calibrate", "{missing}", "{missing}", "--out", "{}"],
]


@pytest.mark.parametrize("kind", ["blocked", "dir"])
@pytest.mark.parametrize("argv", OUTPUTS, ids=lambda a: f"{a[0]}-{a[-2]}")
def test_unwritable_output_is_one_line_before_any_work(paths, capsys, argv, kind):
    """The output is checked first: the missing input behind it is never reached."""
    args = [a.format(paths[kind], missing=paths["missing"]) for a in argv]
    assert main(args) == 2
    err = _one_line(capsys)
    assert f"cannot write {paths[kind]}" in err
    assert ("cannot create its folder" in err) if kind == "blocked" else ("is a directory" in err)


INPUTS = [
    ["plan", "{}", "--pp", "2"],
    ["simulate", "{}"],
    ["calibrate", "{}", "{}", "--out", "{out}"],
    ["verify", "{}", "--model", "tiny-llama"],
]


@pytest.mark.parametrize(("kind", "message"), [("missing", "does not exist"),
                                               ("dir", "is a directory"),
                                               ("binary", "is not a text file")])
@pytest.mark.parametrize("argv", INPUTS, ids=lambda a: a[0])
def test_unreadable_input_is_one_line(paths, capsys, tmp_path, argv, kind, message):
    args = [a.format(paths[kind], out=str(tmp_path / "out.json")) for a in argv]
    assert main(args) == 2
    assert message in _one_line(capsys)
