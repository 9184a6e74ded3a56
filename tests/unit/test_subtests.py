"""run_subtests: every case's failure reported, and a timed-out group's later cases not run."""

import pytest

from commsched.errors import CommunicationTimeout
from commsched.testing import run_subtests


def test_every_failing_case_is_named_and_the_others_still_run():
    ran = []

    def failing(name):
        ran.append(name)
        raise ValueError(f"{name} is wrong")

    cases = {"a": lambda: ran.append("a"), "b": lambda: failing("b"), "c": lambda: pytest.fail("c saw nothing"),
             "d": lambda: ran.append("d")}
    with pytest.raises(AssertionError, match=r"^2 of 4 cases failed:\n\[b\]") as raised:
        run_subtests(cases)
    assert ran == ["a", "b", "d"]
    assert "[c]" in str(raised.value) and "not run" not in str(raised.value)


def test_a_timed_out_case_ends_the_run_and_names_the_cases_left():
    ran = []

    def timed_out():
        try:
            raise RuntimeError("Timed out waiting 60000ms for send operation to complete")
        except RuntimeError as error:
            raise CommunicationTimeout("rank 0: the agreement did not finish within 60 s") from error

    cases = {"a": lambda: ran.append("a"), "b": timed_out, "c": lambda: ran.append("c"),
             "d": lambda: ran.append("d")}
    with pytest.raises(AssertionError, match=r"1 of 4 cases failed:\n\[b\]") as raised:
        run_subtests(cases)
    assert ran == ["a"]
    assert str(raised.value).endswith("2 cases not run, the ranks' collectives having timed out: c, d")
