"""The compile tier's scale cases for the target `v6e` (see tests/compile/tier.py)."""
import pytest

from tests.compile import tier

TARGET = "v6e"


@pytest.mark.parametrize("case_id", tier.case_ids(TARGET, ("scale",)))
def test_compiles(case_id):
  tier.check(TARGET, case_id)
