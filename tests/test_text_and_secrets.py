"""The one text validator (vla_rl/core/text.py), URL masking (vla_rl/core/secrets.py), and where they are
applied below the dashboard: a round's stored config holds no DB password (the worker fills in its own
DB), a run's logged config masks it, the metadata DB refuses bad label text, a selection bad text and
numbers past a 64-bit integer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.db import MetadataDB
from fleet.selection import MAX_DB_INT, EpisodeQuery, Selection
from vla_rl.core.secrets import shown_url, url_without_password
from vla_rl.core.text import check_json_text, check_text, safe_json, safe_text


@pytest.mark.parametrize(
    ("text", "multiline", "message"),
    [
        (
            "a\ud800b",
            False,
            r"value: a lone UTF-16 surrogate \(U\+D800\) at character 1 is not valid Unicode",
        ),
        ("a\x00", False, r"the control character U\+0000 at character 1 is not allowed"),
        ("a\nb", False, r"U\+000A .*one line of text holds no control characters"),
        ("a\rb", True, r"U\+000D .*free text may hold tabs and newlines, no other"),
        ("\x85", True, r"U\+0085"),
        ("\x7f", True, r"U\+007F"),
        ("abc\u202e", True, r"the bidirectional control character U\+202E at character 3"),
        ("x" * 11, False, r"value: expected at most 10 characters, got 11"),
        (3, False, r"value: expected text, got int"),
    ],
)
def test_check_text_refuses_naming_the_field(text: object, multiline: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_text(text, "value", max_chars=10, multiline=multiline)


def test_check_text_passes_what_people_write() -> None:
    for ok in ("gripper slipped", "naïve — ok ✓ 日本語 🤖", "", "x" * 10):
        assert check_text(ok, "note", max_chars=10 if ok.startswith("x") else 100) == ok
    assert check_text("two\nlines\tand a tab", "note", max_chars=100, multiline=True)


def test_check_json_text_walks_every_string_and_bounds_the_size() -> None:
    value = {"repo": "org/x", "list": ["a", {"deep": "b"}], "n": 3, "f": 1.5, "b": True, "none": None}
    assert check_json_text(value, "options", max_chars=10, max_json_chars=200) is value
    with pytest.raises(ValueError, match=r"options\.list\[1\]\.deep: the control character U\+0000"):
        check_json_text({"list": ["a", {"deep": "\x00"}]}, "options", max_chars=10)
    with pytest.raises(ValueError, match=r"options \(a key\): a lone UTF-16 surrogate"):
        check_json_text({"\udfff": 1}, "options", max_chars=10)
    with pytest.raises(ValueError, match="value: expected at most 20 characters as JSON"):
        check_json_text(["abcdefgh"] * 3, "value", max_chars=10, max_json_chars=20)
    with pytest.raises(ValueError, match=r"value\[0\]: expected a JSON value, got bytes"):
        check_json_text([b"x"], "value", max_chars=10)


def test_safe_json_replaces_lone_surrogates_only() -> None:
    assert safe_text("ok ✓") == "ok ✓"
    assert safe_json({"k\ud800": ["a\udfffb", 1, None], "n": 2.5}) == {
        "k\ufffd": ["a\ufffdb", 1, None],
        "n": 2.5,
    }


@pytest.mark.parametrize(
    ("url", "shown", "bare"),
    [
        (
            "postgresql://ana:S3cret@db:5432/vla",
            "postgresql://ana:***@db:5432/vla",
            "postgresql://ana@db:5432/vla",
        ),
        (
            "postgresql+psycopg://ana:p%40ss@db/vla",
            "postgresql+psycopg://ana:***@db/vla",
            "postgresql+psycopg://ana@db/vla",
        ),
        ("postgresql://db/vla?password=S3cret", "postgresql://db/vla?password=***", "postgresql://db/vla"),
        (
            "postgresql://db/vla?sslmode=require&password=S3cret&x=1",
            "postgresql://db/vla?sslmode=require&password=***&x=1",
            "postgresql://db/vla?sslmode=require&x=1",
        ),
        ("postgresql://ana@db:5432/vla", "postgresql://ana@db:5432/vla", "postgresql://ana@db:5432/vla"),
        ("postgresql://db:5432/vla", "postgresql://db:5432/vla", "postgresql://db:5432/vla"),
        (
            "sqlite:////tmp/store/metadata.db",
            "sqlite:////tmp/store/metadata.db",
            "sqlite:////tmp/store/metadata.db",
        ),
        ("not a url at all", "not a url at all", "not a url at all"),
    ],
)
def test_urls_are_shown_masked_and_stored_without_their_password(url: str, shown: str, bare: str) -> None:
    assert shown_url(url) == shown and url_without_password(url) == bare


def test_a_rounds_stored_config_holds_no_password_and_its_worker_uses_its_own_db(tmp_path: Path) -> None:
    from vla_rl.rounds import RoundConfig, config_from_json, config_to_json, training_db_url
    from vla_rl.train.algorithms import make_config
    from vla_rl.train.common import config_dict

    url = "postgresql://ana:S3cret@db:5432/vla"
    train = make_config("awr", base="hub://org/arm@prod", store=tmp_path, out=tmp_path / "o", db_url=url)
    stored = config_to_json(RoundConfig(train=train))
    assert "S3cret" not in str(stored) and stored["train"]["db_url"] == "postgresql://ana@db:5432/vla"
    assert config_from_json(stored).train.db_url == "postgresql://ana@db:5432/vla"
    assert "S3cret" not in str(config_dict(train)) and "ana:***@db" in str(config_dict(train))

    class Worker:  # the DB a worker claimed the round from, opened with its own credentials
        url = "postgresql://ana:S3cret@db:5432/vla"

    db: Any = Worker()
    assert training_db_url(None, db) == db.url
    assert training_db_url("postgresql://ana@db:5432/vla", db) == db.url
    assert training_db_url("postgresql://bob@other/x", db) == "postgresql://bob@other/x"
    with pytest.raises(ValueError, match=r"config\.train\.data: the control character U\+000A"):
        config_to_json(
            RoundConfig(
                train=make_config("awr", base="hub://o/a@prod", store=tmp_path, out=tmp_path, data="a\nb")
            )
        )


def test_the_metadata_db_refuses_bad_label_text(tmp_path: Path) -> None:
    db = MetadataDB(f"sqlite:///{tmp_path / 'meta.db'}")
    for kw, message in (
        ({"value": "bad\ud800"}, r"value: a lone UTF-16 surrogate"),
        ({"value": {"why": ["\x1b[2J"]}}, r"value\.why\[0\]: the control character U\+001B"),
        ({"value": "x", "note": "a\x00"}, r"note: the control character U\+0000"),
        ({"value": "x", "note": "n" * 2001}, r"note: expected at most 2000 characters"),
        ({"value": "x", "key": "k\n"}, r"key: the control character U\+000A"),
        ({"value": "x", "author": "a" * 129}, r"author: expected at most 128 characters"),
    ):
        args = {"key": "note", "author": "ana", **kw}
        with pytest.raises(ValueError, match=message):
            db.add_label("ep-0", args.pop("key"), args.pop("value"), **args)
    with pytest.raises(ValueError, match=r"note: the control character"):
        db.undo_label(1, author="ana", note="\x07")


def test_a_selection_refuses_bad_text_and_numbers_past_a_db_integer() -> None:
    big = str(MAX_DB_INT + 1)
    for text, message in (
        ("robot=sim\x00", r"robot: the control character U\+0000"),
        ("label.quality=go\x7fod", r"label: the control character U\+007F"),
        (f"round={big}", rf"round: expected a round number >= 1 \(at most {MAX_DB_INT}\)"),
        (f"min_length={big}", r"min_length: expected an integer >= 0 \(at most"),
        (f"max={big}", r"max: expected a positive integer \(at most"),
        ("since=1e400", r"since: expected finite unix seconds"),
        ("until=nan", r"until: expected finite unix seconds"),
    ):
        with pytest.raises(ValueError, match=message):
            Selection.parse(text, task="t")
    assert Selection.parse(f"round={MAX_DB_INT},min_length={MAX_DB_INT}", task="t").rounds == (MAX_DB_INT,)
    with pytest.raises(ValueError, match=r"page: expected an integer >= 1 \(at most"):
        EpisodeQuery.from_params({"page": str(10**30)})
