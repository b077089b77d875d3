"""Parallel strategies installed on a diffusers transformer through its family's adapter.

parallelize.py installs them (token chunks, the attention that ShardContext routes to its
strategy); exact.py is ring, Ulysses and USP as one composition (Ulysses over
`ulysses_degree` adjacent ranks, then the ring over the rest); selective.py is DiTango's;
tensor.py splits the blocks' heads and FFN width instead of the tokens.
"""

from runtime.strategies.parallelize import ShardContext, parallelize

__all__ = ["ShardContext", "parallelize"]
