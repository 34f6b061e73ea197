"""The earlier name of :mod:`fuseopt.optim.muon_transforms` (the Muon transforms).

Kept so that existing imports keep working: this module *is*
:mod:`fuseopt.optim.muon_transforms` (the same module object), so its attributes,
private ones included, are that module's.
"""

import sys

from fuseopt.optim import muon_transforms as _module

sys.modules[__name__] = _module
