"""verl's import path for the algorithms (`verl.trainer.ppo.core_algos`, docs/migrating.md): the module
`verl_arpo.algos.core_algos` itself, where they live (docs/algorithms.md), under this name too, so a
registration or a patch through either name is seen through both."""

import sys

from verl_arpo.algos import core_algos as _core_algos

sys.modules[__name__] = _core_algos
