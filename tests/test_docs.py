"""The documentation's commands and links stay true: README.md and docs/*.md (in-process, ~1 s).

Commands. Every ``vla-rl ...`` command in a fenced code block of a shell language (```bash, sh, shell,
console, zsh, or no language) is extracted with these rules:

* a line ending in ``\\`` continues on the next line;
* ``#`` outside quotes starts a comment (shell rules, ``shlex`` with comments), so a command mentioned in a
  comment is not checked;
* a line may hold several commands: the words ``&&``, ``||``, ``;``, ``|`` and ``&`` end one; only those
  whose first word is ``vla-rl`` (or a path ending in ``/vla-rl``) count, after an optional ``$`` prompt
  and ``NAME=value`` environment assignments;
* ``[`` and ``]`` around optional parts are dropped and what they enclose is checked like the rest;
* ``...`` placeholders are dropped;
* the subcommand path is the run of lower-case words (``[a-z][a-z0-9-]*``) right after ``vla-rl``, so the
  docs write positional arguments as paths (with a ``/``), refs, numbers or UPPER-CASE placeholders
  (``vla-rl store info runs/demo/store``, ``vla-rl round show 3``, ``vla-rl hub push FOLDER``); a path
  word ``a|b`` stands for both ``a`` and ``b``;
* options before the path (``vla-rl --log-format json demo``) are global: each takes the next word as
  its value and is checked against ``vla-rl --help``;
* every other ``--flag`` or ``--flag=value`` word is an option of the subcommand.

For each distinct subcommand path, ``vla-rl PATH --help`` runs once, in-process through
``vla_rl.cli.main``; it must exit 0 (an unknown subcommand exits 2), and every option the docs use with
that path must appear in its help text. So the test fails when a documented command or flag disappears.

Links. Every relative Markdown link or image in those files (outside code) must point to an existing file,
and a ``#fragment`` to a heading of the target Markdown file (GitHub's anchor rules). Every docs page is
linked from docs/README.md.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import re
import shlex
from collections import defaultdict
from pathlib import Path

import pytest

from vla_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
OPERATORS = {"&&", "||", ";", "|", "&"}
PATH_WORD = re.compile(r"^[a-z][a-z0-9-]*(\|[a-z][a-z0-9-]*)*$")
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MIN_COMMANDS = 30  # the docs hold more; fewer means the extractor broke


def shell_blocks(text: str) -> list[str]:
    """The contents of fenced code blocks in a shell language (see SHELL_LANGS)."""
    blocks, current, lang, fence = [], [], "", ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if not fence:
            if m:
                fence, lang, current = m.group(1), m.group(2).lower(), []
        elif m and m.group(1).startswith(fence[0]) and not m.group(2):
            if lang in SHELL_LANGS:
                blocks.append("\n".join(current))
            fence = ""
        else:
            current.append(line)
    return blocks


def logical_lines(block: str) -> list[str]:
    """Lines of a block with backslash continuations joined."""
    out, pending = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append(pending + line)
            pending = ""
    if pending:
        out.append(pending)
    return out


def commands_in(line: str) -> list[list[str]]:
    """The vla-rl commands of one logical line, as word lists (brackets and placeholders dropped)."""
    if "vla-rl" not in line:
        return []
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        if line.lstrip().lstrip("$ ").startswith("vla-rl"):
            raise
        return []  # another tool's line with shell syntax shlex cannot read (arrays, heredocs)
    commands, current = [], []
    for w in [*words, ";"]:
        if w in OPERATORS or w.endswith(";"):
            if w.endswith(";") and w != ";":
                current.append(w[:-1])
            commands.append(current)
            current = []
        else:
            current.append(w)
    found = []
    for cmd in commands:
        if cmd and cmd[0] == "$":
            cmd = cmd[1:]
        while cmd and ENV_ASSIGN.match(cmd[0]):
            cmd = cmd[1:]
        if not cmd or not (cmd[0] == "vla-rl" or cmd[0].endswith("/vla-rl")):
            continue
        cleaned = [w.strip("[]") for w in cmd[1:]]
        found.append([w for w in cleaned if w and w != "..."])
    return found


# Options that select what a command's flags are (``round start --algo qam`` takes QAM's knobs): they and
# their value join the path, so ``vla-rl round start --algo qam --help`` is what the docs are checked against.
SELECTORS = {("round", "start"): ("--algo", "--preset")}


def parse_command(words: list[str]) -> tuple[list[tuple[str, ...]], list[str], list[str]]:
    """(subcommand paths, global options, subcommand options) of one command's words."""
    i, global_opts = 0, []
    while i < len(words) and words[i].startswith("--"):
        global_opts.append(words[i].split("=", 1)[0])
        i += 1 if "=" in words[i] else 2
    path_words = []
    while i < len(words) and PATH_WORD.match(words[i]):
        path_words.append(words[i].split("|"))
        i += 1
    rest = words[i:]
    options = [w.split("=", 1)[0] for w in rest if w.startswith("--") and len(w) > 2]
    paths = [tuple(p) for p in itertools.product(*path_words)]
    selected = []
    for p in paths:
        sel = next((o for o in SELECTORS.get(p, ()) if o in rest[:-1]), None)
        values = rest[rest.index(sel) + 1].split("|") if sel else []
        selected += [(*p, sel, v) for v in values] if sel else [p]
    used = {o for p in paths for o in SELECTORS.get(p, ())}
    return selected, global_opts, [o for o in options if o not in used]


def documented_commands() -> list[tuple[str, int, list[str]]]:
    """(file, line-ish index, words) for every vla-rl command in the docs."""
    out = []
    for f in DOC_FILES:
        for block in shell_blocks(f.read_text()):
            for n, line in enumerate(logical_lines(block)):
                for words in commands_in(line):
                    out.append((f.relative_to(ROOT).as_posix(), n, words))
    return out


def options_by_path() -> dict[tuple[str, ...], dict[str, set[str]]]:
    """Subcommand path -> option -> the docs files that use it with that path ('' = global)."""
    table: dict[tuple[str, ...], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for where, _, words in documented_commands():
        paths, global_opts, options = parse_command(words)
        for o in global_opts:
            table[()][o].add(where)
        for p in paths:
            table[p]
            for o in options:
                table[p][o].add(where)
    return {p: dict(v) for p, v in table.items()}


@functools.cache
def help_text(path: tuple[str, ...]) -> tuple[int, str]:
    """Exit status and output of ``vla-rl PATH --help``, in-process, once per path."""
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*path, "--help"])
        except SystemExit as e:
            code = e.code
    return (code if isinstance(code, int) else 1), out.getvalue() + err.getvalue()


def has_option(help_: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_) is not None


PATHS = options_by_path()


def test_the_extractor_follows_the_rules() -> None:
    block = shell_blocks(
        "```bash\n"
        "$ FOO=1 vla-rl --log-format json train qam --base REF \\\n"
        "    [--inv-temp λ --env-steps=100] ...   # vla-rl ignored --in-comments\n"
        "vla-rl round list|show 3 --store runs/x && echo done; vla-rl serve --checkpoint x &\n"
        "python bench/rl.py --algos qam  # not vla-rl\n"
        "```\n```python\nvla-rl demo --in-python\n```\n"
    )
    assert len(block) == 1
    cmds = [c for line in logical_lines(block[0]) for c in commands_in(line)]
    assert cmds == [
        ["--log-format", "json", "train", "qam", "--base", "REF", "--inv-temp", "λ", "--env-steps=100"],
        ["round", "list|show", "3", "--store", "runs/x"],
        ["serve", "--checkpoint", "x"],
    ]
    assert parse_command(cmds[0]) == (
        [("train", "qam")],
        ["--log-format"],
        ["--base", "--inv-temp", "--env-steps"],
    )
    assert parse_command(cmds[1])[0] == [("round", "list"), ("round", "show")]
    # a selector joins the path: the flags of `round start --algo qam` are QAM's
    assert parse_command(["round", "start", "--algo", "awr|qam", "--base", "B"]) == (
        [("round", "start", "--algo", "awr"), ("round", "start", "--algo", "qam")],
        [],
        ["--base"],
    )


def test_the_docs_hold_the_commands_users_run() -> None:
    assert len(documented_commands()) >= MIN_COMMANDS
    for path in [("demo",), ("train", "qam"), ("round", "start"), ("serve",), ("collect",), ("fleet", "sim")]:
        assert any(p[: len(path)] == path for p in PATHS), (
            f"no `vla-rl {' '.join(path)}` in any docs code block"
        )


def test_the_check_catches_a_missing_command_and_flag() -> None:
    code, help_ = help_text(("train", "qam"))
    assert code == 0 and has_option(help_, "--inv-temp") and not has_option(help_, "--inv")
    assert not has_option(help_, "--no-such-flag")
    assert help_text(("train", "no-such-algorithm"))[0] != 0


@pytest.mark.parametrize("path", sorted(PATHS), ids=lambda p: " ".join(p) or "vla-rl")
def test_documented_command_exists_with_its_flags(path: tuple[str, ...]) -> None:
    code, help_ = help_text(path)
    cmd = " ".join(["vla-rl", *path])
    assert code == 0, f"`{cmd} --help` exited {code}:\n{help_[-2000:]}"
    missing = {o: sorted(w) for o, w in PATHS[path].items() if not has_option(help_, o)}
    assert not missing, f"`{cmd}`: options used in the docs but not in its --help: {missing}"


# ---------------------------------------------------------------------------------------------- links
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    keep, fence = [], ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (not fence or m.group(1).startswith(fence[0])):
            fence = "" if fence else m.group(1)
            continue
        if not fence:
            keep.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(keep)


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower-case, punctuation dropped, spaces -> '-'."""
    seen: dict[str, int] = defaultdict(int)
    out = set()
    for line in prose(md.read_text().replace("`", "")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_existing_files(doc: Path) -> None:
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


def test_every_docs_page_is_in_the_index() -> None:
    index = {m.split("#")[0] for m in LINK.findall(prose((DOCS / "README.md").read_text()))}
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= index, f"docs/README.md does not link {sorted(pages - index)}"


# ------------------------------------------------------------------------- the code's citations of docs
CODE_DIRS = ("vla_rl", "fleet", "server", "sim", "policies", "packages", "bench", "scripts", "tests")
SECTION_CITE = re.compile(r"docs/algorithms\.md\s+§(\d[a-z]?)")
OUTSIDE = re.compile(r"\.\./shared/|shared/reference|DESIGN\.md|(?<![\w/])(algorithms|anchors)\.md")


def numbered_sections(md: Path) -> set[str]:
    """The section numbers of a page's ``## 4.`` / ``### 4a.`` headings."""
    return {m.group(1) for m in re.finditer(r"^#{2,3}\s+(\d+[a-z]?)\.\s", md.read_text(), re.M)}


def test_the_code_cites_sections_that_exist_and_nothing_outside_the_repository() -> None:
    """Docstrings point at the equations they implement as docs/algorithms.md §N; every such §N is a
    heading there, and no code cites a file the repository does not ship (the reference notes the
    algorithms page replaced)."""
    sections = numbered_sections(ROOT / "docs" / "algorithms.md")
    assert {"0", "2", "3", "4a", "4d", "5a", "6a", "6b"} <= sections
    missing, outside, cited = [], [], 0
    for folder in CODE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "test_docs.py" or "__pycache__" in path.parts:
                continue
            text = path.read_text()
            rel = path.relative_to(ROOT).as_posix()
            for m in SECTION_CITE.finditer(text):
                cited += 1
                if m.group(1) not in sections:
                    missing.append(f"{rel}: docs/algorithms.md §{m.group(1)}")
            outside += [f"{rel}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert cited > 15, cited
    assert not missing, "citations of sections docs/algorithms.md lacks:\n" + "\n".join(missing)
    assert not outside, "citations of files outside the repository:\n" + "\n".join(outside)
