"""Many test cases inside one group of spawned ranks."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping


def run_subtests(cases: Mapping[str, Callable[[], None]]) -> None:
    """Run every case, then raise one error naming each case that failed.

    Inside a rank, this amortises the seconds a spawned process costs over many
    cases, as FSDP's ``run_subtests`` does. A test framework's own failure
    (pytest's ``fail()``, ``pytest.raises`` that saw nothing) is not an
    ``Exception``, and is collected too: letting it through would hide the
    failures of the cases before it.
    """
    failed: list[str] = []
    for name, case in cases.items():
        try:
            case()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - collect and report them all
            failed.append(f"[{name}]\n{traceback.format_exc()}")
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed))
