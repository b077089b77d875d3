"""Pure decision logic (DiTango reuse plans, Hybridiff schedules, cost model).

Everything here is a function of replicated inputs; it never calls torch.distributed
except through an explicit group argument.
"""

import planner.strategies  # noqa: F401  (registers the built-in strategies before any layout is made)
