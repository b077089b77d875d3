"""The runtime side of the parallel strategies (planner/strategies/ says what each is; its
`runtime` names the module here whose `build` makes what runs it), installed on a diffusers
transformer through its family's adapter.

parallelize.py installs them (token chunks, the attention that ShardContext routes to its
strategy); exact.py is ring, Ulysses and USP as one composition (Ulysses over
`ulysses_degree` adjacent ranks, then the ring over the rest); ditango.py builds DiTango's
runtime, selective.py (its state across steps) and selective_layer.py (one layer);
tensor.py splits the blocks' heads and FFN width instead of the tokens.
"""

from runtime.strategies.parallelize import ShardContext, parallelize

__all__ = ["ShardContext", "parallelize"]
