"""The compile tier's kernel cases for the target `rtx4090` (see tests/compile/tier.py)."""
import pytest

from tests.compile import tier

TARGET = "rtx4090"


@pytest.mark.parametrize("case_id", tier.case_ids(TARGET, ("kernel",)))
def test_compiles(case_id):
  tier.check(TARGET, case_id)
