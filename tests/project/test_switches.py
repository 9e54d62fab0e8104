"""Every ``FUNCTRANS_*`` variable is declared once, in the switch table, and read nowhere else:
no module but ``functrans/_core/switches.py`` touches ``os.environ`` or ``os.getenv``, every
variable the sources name is a switch, and the docs' table is the table's own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from functrans._core import switches
from functrans.extend import SWITCHES, SwitchError, switch_value, switches_overridden

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "functrans").rglob("*.py"))
HOME = ROOT / "functrans" / "_core" / "switches.py"


def _code(path: Path) -> str:
    """The source without docstring examples (``>>>`` lines may set a variable to show it)."""
    return "\n".join(
        line
        for line in path.read_text().splitlines()
        if not line.lstrip().startswith((">>>", "..."))
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_switch_table_reads_the_environment(path: Path) -> None:
    if path == HOME:
        return
    assert not re.search(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(", _code(path)), (
        f"{path.relative_to(ROOT)} reads the environment: declare a switch in "
        "functrans/_core/switches.py and read it with switches.value"
    )


def test_every_variable_named_is_a_switch() -> None:
    named = {m for path in SOURCES for m in re.findall(r"FUNCTRANS_[A-Z_]+[A-Z]", path.read_text())}
    not_switches = named - set(SWITCHES) - {"FUNCTRANS_DIR"}  # a path constant, not a variable
    assert not not_switches, f"named but not declared in the switch table: {sorted(not_switches)}"


def test_the_docs_table_is_the_switch_table() -> None:
    page = (ROOT / "docs" / "switches.md").read_text()
    assert switches.table() in page, "docs/switches.md: paste the output of switches.table()"


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_empty_means_the_default_and_a_bad_value_says_what_is_accepted(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    switch = SWITCHES[name]
    for blank in ("", "  "):
        monkeypatch.setenv(name, blank)
        assert switch_value(switch) == switch.default
    monkeypatch.delenv(name)
    assert switch_value(switch) == switch.default
    if switch.parse is str:
        return  # any text is a path or a list of topics
    monkeypatch.setenv(name, "-maybe-")
    with pytest.raises(SwitchError) as caught:
        switch_value(switch)
    message = str(caught.value)
    assert name in message and "'-maybe-'" in message and switch.accepts in message
    assert switch.default_text() in message


def test_overrides_are_scoped_and_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUNCTRANS_REGIONS", "0")
    with switches_overridden(FUNCTRANS_REGIONS="unrolled"):
        assert switch_value(switches.REGIONS) == "unrolled"
        with switches_overridden(FUNCTRANS_REGIONS=None):
            assert switch_value(switches.REGIONS) == "compiled"  # as if unset
    assert switch_value(switches.REGIONS) == "off"
    with (
        pytest.raises(SwitchError, match="FUNCTRANS_REGION'] are not switches"),
        switches_overridden(FUNCTRANS_REGION="0"),
    ):
        pass
