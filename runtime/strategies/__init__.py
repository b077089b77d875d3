"""Parallel strategies installed on a diffusers transformer through its family's adapter.

ring, ulysses and usp are one composition here: Ulysses (head all-to-all) over
`ulysses_degree` adjacent ranks, then ring attention over the remaining `ring_degree`
ranks; ring is usp with ulysses_degree 1, ulysses is usp with ring_degree 1. tp
(tensor.py) splits the blocks' heads and FFN width instead of the tokens.
"""

from runtime.strategies.parallelize import ShardContext, parallelize

__all__ = ["ShardContext", "parallelize"]
