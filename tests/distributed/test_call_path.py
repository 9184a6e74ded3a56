"""docs/architecture.md's two ways through the code name the files a traced iteration enters, no more, no less."""

import re
from pathlib import Path

from commsched.testing import call_path

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented_files(heading: str) -> set[str]:
    """The ``*.py`` paths named under ``### <heading>`` (up to the next heading)."""
    text = ARCHITECTURE.read_text()
    start = text.index(f"### {heading}")
    end = text.find("\n#", start + 1)
    return set(re.findall(r"`([a-z_]+/[a-z_/]+\.py|[a-z_]+\.py)`", text[start:end]))


def test_the_ways_on_the_architecture_page_are_the_traced_ones():
    ways = call_path.trace(timeout_s=120)
    for heading, way in (("A gradient's way", call_path.gradient_way(ways)),
                         ("A parameter's way", call_path.parameter_way(ways))):
        documented, traced = documented_files(heading), set(way.files)
        assert traced, f"nothing traced for {heading!r}: {sorted(ways)}"
        assert traced <= documented, f"{heading}: entered but not on the page: {sorted(traced - documented)}"
        missing = documented - traced - call_path.SOMETIMES
        assert not missing, f"{heading}: on the page but not entered: {sorted(missing)}"
