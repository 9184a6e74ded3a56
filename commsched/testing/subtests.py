"""Many test cases inside one group of spawned ranks."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping

from torch.overrides import _get_current_function_mode_stack

from commsched.watch.parameter_use import ParameterUseMode


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
        finally:
            end_leftover_watches()
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed))


def end_leftover_watches() -> None:
    """End the warm-up's watches that models a case dropped left running on this thread.

    During warm-up a prepared model watches the loop's parameter reads from one
    ``step()`` to the next with a torch-function mode (see [Note: reads outside the
    forward pass] in `commsched.watch.reads`). A case that stops training within
    warm-up and drops its model without ``commsched.release`` leaves that mode on the
    stack for good, and every torch call after it, in every later case of the
    spawn, passes through it: hundreds of cases made some groups six times slower.
    """
    stack = _get_current_function_mode_stack()
    while stack and isinstance(stack[-1], ParameterUseMode):
        stack[-1].__exit__(None, None, None)
        stack = _get_current_function_mode_stack()
