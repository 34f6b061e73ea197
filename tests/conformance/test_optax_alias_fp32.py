"""optax 0.2.8's own tests (alias group) with fuseopt substituted, fp32 mode
(see tests/conformance/_optax_suite.py and docs/conformance.md)."""

from tests.conformance import _optax_suite

OPTAX_CONFORMANCE_MODE = "fp32"

globals().update(_optax_suite.load(OPTAX_CONFORMANCE_MODE, "alias"))
