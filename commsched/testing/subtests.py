"""Many test cases inside one group of spawned ranks."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping

from torch.overrides import _get_current_function_mode_stack

from commsched.errors import CommunicationTimeout
from commsched.watch.parameter_use import ParameterUseMode


def run_subtests(cases: Mapping[str, Callable[[], None]]) -> None:
    """Run every case, then raise one error naming each case that failed.

    Inside a rank, this amortises the seconds a spawned process costs over many
    cases, as FSDP's ``run_subtests`` does. A test framework's own failure
    (pytest's ``fail()``, ``pytest.raises`` that saw nothing) is not an
    ``Exception``, and is collected too: letting it through would hide the
    failures of the cases before it.

    A case that ends in a `CommunicationTimeout` ends the run: the ranks are out of
    step (or gloo has closed the pair), so every later case would wait out its own
    timeout and fail the same way, minutes later and hiding which case broke it.
    """
    failed: list[str] = []
    not_run = ""
    names = list(cases)
    for index, name in enumerate(names):
        try:
            cases[name]()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # noqa: BLE001 - collect and report them all
            failed.append(f"[{name}]\n{traceback.format_exc()}")
            if _timed_out(error) and index + 1 < len(names):
                rest = names[index + 1:]
                not_run = f"\n{len(rest)} cases not run, the ranks' collectives having timed out: {', '.join(rest)}"
                break
        finally:
            end_leftover_watches()
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed) + not_run)


def _timed_out(error: BaseException) -> bool:
    """``error`` is, or was raised from, a `CommunicationTimeout`."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, CommunicationTimeout):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
