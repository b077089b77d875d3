"""The built-in parallel strategies (planner/strategy.py says what one is), registered in the
order the CLI lists them. A new strategy: a module here and one line below."""

from planner.strategies.ditango import DITANGO
from planner.strategies.exact import RING, ULYSSES, USP
from planner.strategies.single import NONE
from planner.strategies.tensor import TP
from planner.strategy import register

for strategy in (NONE, RING, ULYSSES, USP, DITANGO, TP):
    register(strategy)
