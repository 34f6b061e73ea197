"""optax 0.2.8's own tests (transforms group) with fuseopt substituted, bf16 mode
(see tests/conformance/_optax_suite.py and docs/conformance.md)."""

from tests.conformance import _optax_suite

OPTAX_CONFORMANCE_MODE = "bf16"

globals().update(_optax_suite.load(OPTAX_CONFORMANCE_MODE, "transforms"))
