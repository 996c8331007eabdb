"""Shared prefixes found in prompts given as text, the way vLLM's prefix cache finds them.

A user's file says nothing about what its prompts share, yet a real server with prefix
caching hits whatever they do share: a system prompt, a conversation's history resent
at each turn.  vLLM finds it by hashing each full block of prompt tokens chained with its
parent's hash; two prompts hit the same cached block when their chains are equal up to
it.  :class:`SharedBlocks` does the same over 16-token blocks (the finest block size a
server uses), in file order and in bounded memory, so the simulator's prefix cache
(``Request.prefix``) and ``autotune workload`` see the same sharing the server would.
"""

from __future__ import annotations

from collections.abc import Sequence

# The finest KV block a server uses (vLLM's GPU default; vLLM-CPU uses 128): sharing found
# at 16 tokens holds at any multiple of it.
BLOCK = 16
# Blocks hashed per prompt: prefixes past 8,192 tokens are not looked for.
MAX_BLOCKS = 512
# Distinct block hashes kept (about 150 MB): past it, new blocks are not remembered, so
# a prompt can only be found to share blocks already seen.
MAX_HASHES = 2_000_000

Prefix = tuple[tuple[str, int], ...]


def chain(ids: Sequence[int], blocks: int) -> list[int]:
    """The chained hashes of the first ``blocks`` full blocks of ``ids``: block i's hash
    covers every token before its end, as vLLM's block hash does through its parent."""
    out: list[int] = []
    h = 0
    for i in range(min(len(ids) // BLOCK, blocks)):
        h = hash((h, tuple(ids[i * BLOCK:(i + 1) * BLOCK])))
        out.append(h)
    return out


def prefix_of(ids: Sequence[int], depth: int) -> Prefix:
    """``Request.prefix`` for a prompt whose first ``depth`` blocks are shared: one
    segment per block, keyed by its chained hash, so that each block gets the same key
    in every prompt that holds it (whatever block size the simulator then uses)."""
    return tuple((f"h{h & 0xFFFF_FFFF_FFFF_FFFF:016x}", BLOCK * (i + 1))
                 for i, h in enumerate(chain(ids, depth)))


class SharedBlocks:
    """How many leading blocks each prompt shares with any other prompt (before or after
    it), from their token ids in order: ``depth[i]`` for the i-th prompt added."""

    def __init__(self, *, max_hashes: int = MAX_HASHES) -> None:
        self._first: dict[int, int] = {}  # a chained hash -> the first prompt that had it
        self._max = max_hashes
        self.depth: list[int] = []
        self.full = False  # the hash table filled up: later sharing may be missed

    def add(self, ids: Sequence[int] | None) -> None:
        """The next prompt's token ids (None: a prompt made up of random words, which
        shares nothing)."""
        me = len(self.depth)
        self.depth.append(0)
        if ids is None:
            return
        for i, h in enumerate(chain(ids, MAX_BLOCKS)):
            first = self._first.get(h)
            if first is not None:
                # Chained: a match at block i is a match at every block before it.
                self.depth[first] = max(self.depth[first], i + 1)
                self.depth[me] = i + 1
            elif len(self._first) < self._max:
                self._first[h] = me
            else:
                self.full = True

    @property
    def shared(self) -> int:
        """Prompts that share at least one block with another."""
        return sum(1 for d in self.depth if d)
