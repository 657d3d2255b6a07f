"""The docs stay true to the code: the generated configuration page is current, the shell
examples parse with the CLI's own parser, every CLI command is documented, every link
resolves, and the README stays short and starts with the two commands.

The README's Python examples and its curl run for real in
tests/integration/test_docs_examples.py (they need the default model).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex

import pytest

from pagedinfer.entrypoints.cli import build_parser
from pagedinfer.entrypoints.gen_docs import DOC_PATH, REGENERATE_COMMAND, render

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
# The dated benchmark log is kept as it was written; its commands are history, not examples.
DOC_FILES = [README] + sorted(
    p for p in glob.glob(os.path.join(ROOT, "docs", "*.md")) if not p.endswith("-log.md")
)
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _blocks(path: str, lang: str) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(_read(path)) if m.group(1) == lang]


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _shell_commands(block: str) -> list[list[str]]:
    """Each simple command of a bash block, as argv (continuations joined, comments,
    `&&`, `;`, `|` and a trailing `&` split off)."""
    commands: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="&;|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set("&;|"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
        if current:
            commands.append(current)
    return commands


def _all_shell_commands() -> list[tuple[str, list[str]]]:
    return [
        (_rel(path), argv)
        for path in DOC_FILES
        for block in _blocks(path, "bash")
        for argv in _shell_commands(block)
    ]


def test_configuration_page_is_current() -> None:
    with open(DOC_PATH, encoding="utf-8") as f:
        committed = f.read()
    assert committed == render(), (
        f"docs/configuration.md is stale: run `{REGENERATE_COMMAND}` and commit the result"
    )


def test_readme_opens_with_make_run_and_make_test() -> None:
    head = _read(README)[:400]
    assert "make run" in head and "make test" in head


def test_readme_is_short() -> None:
    assert len(_read(README).splitlines()) < 200


def test_scheduler_is_two_links_from_the_readme() -> None:
    assert "(docs/architecture.md)" in _read(README)
    assert "(../pagedinfer/core/scheduler.py)" in _read(
        os.path.join(ROOT, "docs", "architecture.md")
    )


def test_pagedinfer_commands_in_the_docs_parse() -> None:
    checked = 0
    for where, argv in _all_shell_commands():
        if not os.path.basename(argv[0]) == "pagedinfer":
            continue
        checked += 1
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            # `--help` exits 0 after printing; anything else is a flag the CLI refuses.
            assert exc.code == 0, f"{where}: `{shlex.join(argv)}` does not parse"
    assert checked > 20


def test_make_targets_in_the_docs_exist() -> None:
    targets = set(re.findall(r"^([\w-]+):", _read(os.path.join(ROOT, "Makefile")), re.M))
    for where, argv in _all_shell_commands():
        if argv[0] == "make":
            names = [a for a in argv[1:] if "=" not in a]
            assert set(names) <= targets, f"{where}: `{shlex.join(argv)}`"


def test_curl_examples_send_json_to_the_default_server() -> None:
    curls = [(where, argv) for where, argv in _all_shell_commands() if argv[0] == "curl"]
    assert curls
    for where, argv in curls:
        url = next(a for a in argv if a.startswith("http"))
        assert url.startswith("http://127.0.0.1:8000/"), f"{where}: {url}"
        if "-d" in argv:
            json.loads(argv[argv.index("-d") + 1])


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_python_examples_compile(path: str) -> None:
    for i, block in enumerate(_blocks(path, "python")):
        compile(block, f"{_rel(path)} python block {i}", "exec")


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append(f"{prefix} {name}")
                found.extend(_commands(sub, f"{prefix} {name}"))
    return found


def test_every_cli_command_is_documented() -> None:
    text = "\n".join(_read(p) for p in DOC_FILES)
    for command in _commands(build_parser(), "pagedinfer"):
        assert command in text, command


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    text = _FENCE.sub("", _read(path))
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("path", DOC_FILES, ids=_rel)
def test_links_resolve(path: str) -> None:
    text = _FENCE.sub("", _read(path))
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # an external URL
        file_part, _, anchor = target.partition("#")
        dest = (
            os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        )
        assert os.path.exists(dest), f"{_rel(path)}: {target} does not exist"
        assert os.path.commonpath([ROOT, dest]) == ROOT, f"{_rel(path)}: {target} leaves the repo"
        if anchor and dest.endswith(".md"):
            assert anchor in _anchors(dest), f"{_rel(path)}: no heading for #{anchor}"
