"""The compile tier: every CI case of every target, by kind (see tests/compile/tier.py).

A target is picked up from its entry in :data:`fuseopt.targets.TARGETS`
alone; test ids are ``<target>/<case id>``.
"""
import pytest

from tests.compile import tier


@pytest.mark.parametrize("target,case_id", tier.params("kernel"))
def test_kernel(target, case_id):
  tier.check(target, case_id)


@pytest.mark.parametrize("target,case_id", tier.params("step"))
def test_step(target, case_id):
  tier.check(target, case_id)


@pytest.mark.parametrize("target,case_id", tier.params("sharded"))
def test_sharded(target, case_id):
  tier.check(target, case_id)


@pytest.mark.parametrize("target,case_id", tier.params("scale"))
def test_scale(target, case_id):
  tier.check(target, case_id)
