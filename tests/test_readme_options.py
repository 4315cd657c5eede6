"""The README's option tables against the commands: every option a table names is one the command takes, every
option the command takes is in its table, and a default the README gives is the one the command uses."""

import re
from pathlib import Path

import pytest

from cryorefine import cli

README = Path(__file__).resolve().parents[1] / "README.md"
#: the sentence or heading above each command's table
ANCHORS = {"refine": "A RELION auto-refine command line runs", "classify": "### `cryorefine classify`"}


def readme_table(command):
    """(the text between the anchor and the table, the table's rows) for `command`."""
    text = README.read_text()
    after = text[text.index(ANCHORS[command]):]
    lines = after.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[:start]), lines[start + 2:end]


def options_in(text):
    return set(re.findall(r"`(--\w+)", text))


def taken(command):
    return {p.opts[0] for p in cli.cli.commands[command].params}


def table_options(command):
    _, rows = readme_table(command)
    return {option for row in rows for option in options_in(row.split("|")[1])}


def test_the_refine_table_names_exactly_refines_options():
    assert table_options("refine") == taken("refine")


def test_the_classify_section_names_classifys_options_and_those_of_refine_it_refuses():
    """classify's table holds its own options; the sentence above it names the options of refine it does not take
    (and refuses); the rest of refine's table is classify's too."""
    intro, _ = readme_table("classify")
    not_taken = options_in(intro)
    assert not_taken == taken("refine") - taken("classify")
    assert table_options("classify") <= taken("classify")
    assert taken("classify") <= table_options("classify") | (table_options("refine") - not_taken)


def readme_defaults():
    """(command, option, default) for each table row that says "(default X" of its first option."""
    found = []
    for command in ANCHORS:
        for row in readme_table(command)[1]:
            cells = row.split("|")
            match = re.search(r"\(default:? ([-\w.]+)[;,)]", cells[2])
            if match and options_in(cells[1]):
                found.append((command, sorted(options_in(cells[1]))[0], match.group(1)))
    return found


@pytest.mark.parametrize("command, option, default", readme_defaults())
def test_a_default_the_readme_gives_is_the_one_used(command, option, default):
    param = next(p for p in cli.cli.commands[command].params if p.opts[0] == option)
    assert param.default is not None
    used = param.default
    try:
        assert float(default) == float(used), (command, option, default, used)
    except ValueError:
        assert default == str(used), (command, option, default, used)


def test_the_readme_gives_defaults_to_check():
    assert {("refine", "--iter", "50"), ("classify", "--iter", "25")} <= set(readme_defaults())
