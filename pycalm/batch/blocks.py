"""The paged KV cache's bookkeeping: a pool of blocks, a block table per sequence, and the prefix
cache (full blocks keyed by a chain hash, shared by reference count, evicted least recently used).

Layout. The pool holds n_blocks blocks of block_size positions (a power of two). A sequence's block
table is a list of block ids; key t of the sequence lives in pool row
  table[t >> log2(block_size)] * block_size + (t & (block_size - 1)),
the layout pycalm.kernels.attention reads paged (its "pages" are these blocks). Nothing here
touches a device: the manager hands out ids, and an engine writes and reads the rows.

A block is in exactly one state:
  owned   ref_count > 0: in the tables of ref_count sequences;
  cached  ref_count 0 with a key: its rows still hold a prefix's keys and values; it sits in the
          LRU list, and a new sequence that starts with that prefix takes it back;
  free    ref_count 0 without a key: in the free list.
A new block comes from the free list, else the least recently released cached block is evicted
(its key dropped); when neither has one, the operation raises OutOfBlocks and changes nothing.

Keys (prefix caching). A block's key is blake2b(parent key + its block_size tokens): the chain
hash of everything up to its end, so equal keys mean equal prefixes (a 128-bit digest, not
Python's hash: a crafted collision would hand one user's cached rows to another's prompt). A block
gets its key only when it is FULL and its rows are COMPUTED (`computed` says how many positions an
engine has written): a sequence that takes a cached block reads rows that exist. Two sequences
that compute the same block independently keep one keyed copy; the second stays unkeyed and is
plain free when released.

The sharing rule. Only keyed blocks are shared, and a keyed block is full and computed, so no
sequence ever writes a shared block: a sequence writes only positions >= its `computed`, which lie
in blocks past its computed full ones. `allocate` reuses at most (len(tokens) - 1) // block_size
blocks, so at least the last prompt token is fed (its logits give the first new token) and the
first position written lies in a block the sequence owns alone. Hence no copy-on-write.

Released blocks enter the LRU list last block first, so a chain's tail is evicted before its
head (a head evicted first would leave its tail unreachable and still holding space).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_SIZE = 16  # positions a block: vLLM's default; a prefix is reused to the last full block


class OutOfBlocks(Exception):
    """No free block and no cached block to evict: the caller preempts a sequence or waits."""


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The chain hash of a full block: its parent block's key (None for the first) and its tokens."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class SeqBlocks:
    """One sequence's view: its table, its tokens (one a position with a slot), how many positions
    an engine has written, the keys of its leading full computed blocks (the hash chain), and how
    many prompt tokens the prefix cache supplied when it was allocated."""

    table: list[int]  # block ids, blocks_for(len(tokens)) of them
    tokens: list[int]  # the token at each position that has a slot
    computed: int  # positions [0, computed) hold keys and values
    keys: list[bytes] = field(default_factory=list)  # (computed // block_size,) chain keys
    cached_tokens: int = 0


class BlockManager:
    """The pool's blocks, the sequences' tables and the prefix cache; see the module docstring."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block size {block_size} is not a power of two")
        if n_blocks < 1:
            raise ValueError(f"a pool needs at least one block, not {n_blocks}")
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.ref_count = [0] * n_blocks  # (n_blocks,) sequences holding each block
        self.key: list[bytes | None] = [None] * n_blocks  # (n_blocks,) the block's chain key, if any
        self.free_list: deque[int] = deque(range(n_blocks))  # unkeyed, ref 0
        self.lru: OrderedDict[int, None] = OrderedDict()  # keyed, ref 0, least recently released first
        self.by_key: dict[bytes, int] = {}  # every key held by a block -> that block
        self.seqs: dict[int, SeqBlocks] = {}
        self.prompt_tokens = 0  # tokens `allocate` was asked for, over its life
        self.hit_tokens = 0  # of those, the ones the prefix cache supplied

    # -- sizes and counts (what /metrics shows) ------------------------------------------------

    def blocks_for(self, n_positions: int) -> int:
        """Blocks that hold n_positions positions."""
        return -(-n_positions // self.block_size)

    @property
    def used(self) -> int:
        """Blocks owned by at least one sequence."""
        return self.n_blocks - len(self.free_list) - len(self.lru)

    @property
    def free(self) -> int:
        """Blocks that hold nothing."""
        return len(self.free_list)

    @property
    def cached(self) -> int:
        """Blocks owned by no sequence that still hold a reusable prefix (evicted on demand)."""
        return len(self.lru)

    @property
    def available(self) -> int:
        """Blocks a new allocation may take: free ones, then cached ones by eviction."""
        return len(self.free_list) + len(self.lru)

    @property
    def hit_rate(self) -> float:
        """Share of allocated prompt tokens that the prefix cache supplied (0 before any)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def whole(self) -> bool:
        """True when no sequence holds a block: every block is free or cached."""
        return not self.seqs and self.available == self.n_blocks

    # -- operations ----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached or owned blocks that hold tokens' leading full blocks, at most
        (len(tokens) - 1) // block_size of them (the last token is always fed)."""
        bs, found, parent = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            parent = block_key(parent, tokens[i * bs : (i + 1) * bs])
            block = self.by_key.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, tokens: Sequence[int], reserve: int = 0) -> bool:
        """Whether `allocate(tokens)` would succeed and still leave `reserve` blocks available."""
        return self._fits(self.match(tokens), len(tokens), reserve)

    def _fits(self, reused: list[int], n_tokens: int, reserve: int = 0) -> bool:
        """Whether n_tokens' blocks fit, `reused` of them from the prefix cache, leaving `reserve`."""
        from_cache = sum(1 for b in reused if self.ref_count[b] == 0)  # they leave the LRU list
        new = self.blocks_for(n_tokens) - len(reused)
        return new + from_cache + reserve <= self.available

    def allocate(self, seq: int, tokens: Sequence[int]) -> int:
        """Give sequence `seq` slots for tokens (a prompt, or a preempted sequence's prompt and
        output), reusing cached full blocks of its prefix. Returns the number of cached tokens:
        positions [0, cached) are already computed, the caller feeds the rest. Raises
        OutOfBlocks (changing nothing) when the blocks do not fit."""
        if seq in self.seqs:
            raise ValueError(f"sequence {seq} already has blocks")
        if not tokens:
            raise ValueError("a sequence starts with at least one token")
        reused = self.match(tokens)
        if not self._fits(reused, len(tokens)):
            raise OutOfBlocks(f"{self.blocks_for(len(tokens))} blocks for {len(tokens)} tokens do not fit")
        for b in reused:
            if self.ref_count[b] == 0:
                del self.lru[b]
            self.ref_count[b] += 1
        table = reused + [self._take() for _ in range(self.blocks_for(len(tokens)) - len(reused))]
        cached = len(reused) * self.block_size
        keys = [self.key[b] or b"" for b in reused]  # reused blocks are keyed
        self.seqs[seq] = SeqBlocks(table, list(tokens), cached, keys, cached)
        self.prompt_tokens += len(tokens)
        self.hit_tokens += cached
        return cached

    def append(self, seq: int, token: int) -> None:
        """Give sequence `seq` a slot for one more token (its next position), taking a new block
        when the position starts one. Raises OutOfBlocks (changing nothing) when none is left."""
        s = self.seqs[seq]
        if len(s.tokens) % self.block_size == 0:
            if not self.available:
                raise OutOfBlocks(f"no block for position {len(s.tokens)} of sequence {seq}")
            s.table.append(self._take())
        s.tokens.append(token)

    def computed(self, seq: int, n_positions: int) -> None:
        """Record that an engine has written positions [0, n_positions) of sequence `seq`; its
        full blocks among them get their keys and become reusable."""
        s = self.seqs[seq]
        if not s.computed <= n_positions <= len(s.tokens):
            raise ValueError(
                f"sequence {seq}: computed {n_positions} outside [{s.computed}, {len(s.tokens)}]"
            )
        s.computed = n_positions
        bs = self.block_size
        for i in range(len(s.keys), n_positions // bs):
            k = block_key(s.keys[-1] if s.keys else None, s.tokens[i * bs : (i + 1) * bs])
            s.keys.append(k)
            if k not in self.by_key:  # else an equal block is keyed already: this one stays plain
                self.by_key[k] = s.table[i]
                self.key[s.table[i]] = k

    def free_seq(self, seq: int) -> None:
        """Release sequence `seq`'s blocks: a block no sequence holds any more becomes cached
        (keyed) or free. The table is released last block first (the LRU evicts tails first)."""
        s = self.seqs.pop(seq)
        for b in reversed(s.table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.key[b] is not None:
                    self.lru[b] = None
                else:
                    self.free_list.append(b)

    def table(self, seq: int) -> list[int]:
        """Sequence `seq`'s block table (the manager's own list: read, don't change)."""
        return self.seqs[seq].table

    def _take(self) -> int:
        """A block for one owner: a free one, else the least recently released cached one
        (evicted: its key dropped). The caller has checked that one is available."""
        if self.free_list:
            b = self.free_list.popleft()
        else:
            b, _ = self.lru.popitem(last=False)
            self.by_key.pop(self.key[b] or b"")  # blocks in the LRU are keyed
            self.key[b] = None
        self.ref_count[b] = 1
        return b

    # -- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants (tests call it after every operation): each block is free, cached
        or owned, never two; reference counts match the tables; keys and by_key agree; a block
        with a position not yet computed is owned alone and unkeyed; shared blocks are keyed."""
        free, lru = set(self.free_list), set(self.lru)
        assert len(free) == len(self.free_list), "a block is twice in the free list"
        assert not free & lru, "a block is both free and cached"
        refs = [0] * self.n_blocks
        for seq, s in self.seqs.items():
            assert len(s.table) == self.blocks_for(len(s.tokens)), (
                f"sequence {seq}: table of {len(s.table)} blocks for {len(s.tokens)} tokens"
            )
            assert len(set(s.table)) == len(s.table), f"sequence {seq} holds a block twice"
            assert 0 <= s.cached_tokens <= s.computed <= len(s.tokens)
            assert len(s.keys) == s.computed // self.block_size, (
                f"sequence {seq}: {len(s.keys)} keys for {s.computed} computed"
            )
            for i, b in enumerate(s.table):
                refs[b] += 1
                if (i + 1) * self.block_size > s.computed:  # a block the sequence still writes
                    assert self.key[b] is None, f"block {b} is keyed before it is full and computed"
        for b in range(self.n_blocks):
            assert refs[b] == self.ref_count[b], (
                f"block {b}: ref_count {self.ref_count[b]}, held {refs[b]} times"
            )
            states = (b in free) + (b in lru) + (refs[b] > 0)
            assert states == 1, f"block {b} is in {states} states"
            assert (b in free) <= (self.key[b] is None), f"free block {b} has a key"
            assert (b in lru) <= (self.key[b] is not None), f"cached block {b} has no key"
            if refs[b] > 1:
                assert self.key[b] is not None, f"block {b} is shared but unkeyed"
            if (k := self.key[b]) is not None:
                assert self.by_key.get(k) == b, f"block {b}'s key maps elsewhere"
        assert len(self.by_key) == sum(k is not None for k in self.key), "by_key holds a key no block has"
        assert self.used + self.free + self.cached == self.n_blocks
