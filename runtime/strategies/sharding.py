"""How a token sequence is split over ranks.

Uneven contiguous chunks, no padding: rank i of P gets S // P tokens plus one more
when i < S % P (32,760 tokens over 16 ranks: 8 ranks of 2,048 and 8 of 2,047). Every
rank can compute every chunk's size from (S, P) alone, so receivers size their buffers
without a handshake, and attention needs no masking.
"""

from __future__ import annotations


def chunk_sizes(total: int, parts: int) -> list[int]:
    if total < parts:
        raise ValueError(f"cannot split {total} tokens over {parts} ranks: every rank needs at least one token")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunk_bounds(sizes: list[int], index: int) -> tuple[int, int]:
    start = sum(sizes[:index])
    return start, start + sizes[index]
