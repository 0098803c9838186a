"""CLI error paths: bad input exits 2 with one line that names the flag and how to fix it (in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vla_rl.cli import CliError, _user_errors, main


def test_user_errors_turns_only_the_listed_exceptions_into_one_line() -> None:
    with (
        pytest.raises(CliError, match=r"^--x bad value\. fix it$") as err,
        _user_errors(ValueError, prefix="--x ", suffix=". fix it"),
    ):
        raise ValueError("bad value")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(KeyError), _user_errors(ValueError):
        raise KeyError("not user input")
    with _user_errors(ValueError):
        pass  # no error, no CliError


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["store", "info", "{tmp}/nope"], ["Create one with: vla-rl sim demos --store {tmp}/nope"]),
        (["round", "list", "--store", "{tmp}", "--task", "NoSuchTask"], ["--task ", "See: vla-rl sim list"]),
        (["eval", "--checkpoint", "{tmp}/missing"], ["--checkpoint {tmp}/missing: "]),
        (["client", "act", "--server", "127.0.0.1:1", "--timeout", "0.3"], ["127.0.0.1:1: UNAVAILABLE"]),
    ],
    ids=["store", "task", "eval", "client"],
)
def test_bad_input_exits_2_with_a_hint(
    argv: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w.replace("{tmp}", str(tmp_path)) in err, err
