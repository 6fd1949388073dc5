"""The router's view of where prompt prefixes live: an approximate per-instance index of
the block hashes it has routed there, as SGLang's gateway (an approximate radix tree per
worker) and llm-d's prefix scorer (an LRU of block hashes per pod) keep one.

The router never sees an engine's cache. It records, for each instance, the block hashes
of the prompts it sent there, most recently routed last, and forgets the least recently
routed once an instance holds more than its cache has blocks (``num_kv_blocks``): the
cache's own eviction is least recently freed first, which routing order approximates.
The index errs both ways: it counts blocks the engine has evicted early (its running
requests take blocks the index does not count) and misses blocks of requests another
router replica sent there.

A request's hashes are recorded last block first, so a prompt's first block is the most
recent of its chain. Every later touch of a block comes from a prompt with the same
prefix (a chained hash names its whole prefix), which touches the blocks before it after
it; so a block is never older than the ones after it, and what is indexed of a chain is
always a prefix of it. ``match`` finds the longest indexed prefix by bisection.

**Names of prefixes.** Live, the router and the emulator count a prompt's tokens as its
whitespace-separated words (``olproute.server.schema.count_words``), and both name its
blocks the same way: ``text_block_hashes`` cuts the words into blocks of ``block_size``,
full blocks only, and chains a 63-bit blake2b hash over them (a block's hash names its
whole prefix). A real vLLM hashes its tokenizer's tokens, which the router never sees: the
router's hashes are its own names for prefixes, as SGLang's router matches characters
rather than tokens. They need only be consistent with themselves, which is all the
index needs; a block of words is about a block of tokens for the router's accounting.
A prompt given as token ids is cut into blocks of ids (``id_block_hashes``, chained from
a root of its own); those are the tokenizer's, so only the hash function differs from
vLLM's there.

Where a backend publishes its cache's events (vLLM's KV-events stream: BlockStored /
BlockRemoved / AllBlocksCleared per engine, over ZMQ), its index is exact instead: fed
by ``stored`` / ``removed`` / ``clear`` from a subscriber of that backend
(``olproute.server.kv_subscriber``), keyed by the engine's own block hashes
(``olproute.routing.block_hash``); ``match`` and what the policies read are the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from hashlib import blake2b

import numpy as np
import numpy.typing as npt

from olproute.types import InstanceSpec, PrefixMatch

IntArray = npt.NDArray[np.int64]

_MASK_63 = np.uint64((1 << 63) - 1)
_MASK_64 = (1 << 64) - 1
# the digest before a chain's first block: of words, and of token ids (their own space)
_ROOT = b"\xff" * 8
_ID_ROOT = b"\xfe" * 8


def text_block_hashes(text: str, block_size: int, max_blocks: int | None = None
                      ) -> IntArray:
    """The chained hashes of a prompt text's full blocks of ``block_size`` whitespace
    words (``str.split``; at most ``max_blocks`` of them): block i's digest is
    ``d_i = blake2b(d_{i-1} + its words joined by a space, encoded UTF-8, digest_size=8)``
    with ``d_{-1} = b"\\xff" * 8``, and its hash ``d_i`` as a little-endian integer with
    its top bit cleared (an int64 >= 0). So a block's hash names the block and every
    word before it; it is the same in every process (no salted ``hash()``). A partial
    last block has no hash. A read-only int64 array.

    Cost: one blake2b call per block, about 3x ``str.split`` of the same text (which the
    request path pays anyway to count its words): 0.5-0.7 ms for 7,000 words in blocks
    of 16 on the development machine (``bench/bench_prefix_hash.py``)."""
    words = text.split()
    n = _num_blocks(len(words), block_size, max_blocks)
    join = " ".join
    return _chained(_ROOT, (join(words[i:i + block_size]).encode("utf-8", "surrogatepass")
                            for i in range(0, n * block_size, block_size)))


def id_block_hashes(ids: Sequence[int], block_size: int, max_blocks: int | None = None
                    ) -> IntArray:
    """``text_block_hashes`` for a prompt given as token ids: blocks of ``block_size``
    ids, each block's bytes its ids as little-endian int64, chained from a root of their
    own (``b"\xfe" * 8``), so that id prompts share prefixes with id prompts only. The
    router and the emulator hash a token-id prompt this way."""
    n = _num_blocks(len(ids), block_size, max_blocks)
    if n == 0:
        return _chained(_ID_ROOT, ())
    head = ids[:n * block_size]
    try:
        raw = np.asarray(head, dtype="<i8").tobytes()
    except OverflowError:   # an id past 64 bits (the backend judges it): its low 64 bits
        raw = np.array([int(t) & _MASK_64 for t in head], dtype="<u8").tobytes()
    width = 8 * block_size
    return _chained(_ID_ROOT, (raw[i:i + width] for i in range(0, len(raw), width)))


def prompt_block_hashes(text: str | None, ids: Sequence[int] | None, block_size: int,
                        prompt_tokens: int) -> IntArray | None:
    """A live prompt's block hashes, as the router and the emulator both name them: of
    its text when it has one (``text_block_hashes``), else of its token ids
    (``id_block_hashes``), at most its full blocks of ``prompt_tokens``; None with
    neither."""
    if text is not None:
        return text_block_hashes(text, block_size, prompt_tokens // block_size)
    return None if ids is None else id_block_hashes(ids, block_size,
                                                    prompt_tokens // block_size)


def _num_blocks(length: int, block_size: int, max_blocks: int | None) -> int:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = length // block_size
    return n if max_blocks is None else min(n, max(max_blocks, 0))


def _chained(root: bytes, blocks: Iterable[bytes]) -> IntArray:
    """The chain of blake2b digests over ``blocks`` from ``root``, as int64 >= 0."""
    digests: list[bytes] = []
    d = root
    for block in blocks:
        d = blake2b(d + block, digest_size=8).digest()
        digests.append(d)
    hashes = (np.frombuffer(b"".join(digests), dtype="<u8") & _MASK_63).astype(np.int64)
    hashes.setflags(write=False)
    return hashes


class PrefixIndex:
    """Per instance, the block hashes believed cached there, bounded by the instance's KV
    blocks (``capacity``; default each spec's ``num_kv_blocks``). Instances without prefix
    caching index nothing and match nothing.

    Each instance's index is in one of two modes. **Approximate** (the default): an LRU
    set of the hashes routed there (``routed``), aged by routing order. **Exact**
    (``set_exact``): what the engine itself says it holds, from its KV events
    (``stored``, ``removed``, ``clear``; ``olproute.server.kv_subscriber`` live,
    ``olproute.sim.cluster`` from a simulated engine's cache); routing records nothing
    there. An exact instance may name blocks its own way (a real engine's hashes of its
    tokenizer's tokens: ``Request.engine_block_hashes``) and have a block size of its
    own; what it holds need not be a prefix-closed set (an engine evicts any free
    block), so its match walks the prompt's blocks from the front and stops at the first
    one missing, as the engine's own lookup does. An engine may hold several copies of
    one block (vLLM does not deduplicate: two requests that prefill a block at once both
    register it), so an exact index counts them per key: stored +1, removed -1, the key
    gone at 0, and one copy's eviction keeps the block matched while another is held.
    More keys than ``capacity`` (an engine with more blocks than its profile says) drop
    the oldest stored first, all its copies, counted in ``overflowed``."""

    __slots__ = ("_blocks", "block_size", "block_sizes", "capacity", "enabled", "exact",
                 "overflowed")

    def __init__(self, specs: Sequence[InstanceSpec],
                 capacity: Sequence[int] | None = None) -> None:
        sizes = {s.block_size for s in specs}
        if len(sizes) > 1:
            raise ValueError(f"the prefix index needs one block size, the instances have "
                             f"{sorted(sizes)}")
        self.block_size = sizes.pop() if sizes else 16
        self.block_sizes = [self.block_size] * len(specs)
        cap = [s.num_kv_blocks for s in specs] if capacity is None else list(capacity)
        if len(cap) != len(specs) or any(c < 0 for c in cap):
            raise ValueError("capacity needs one non-negative count per instance")
        self.capacity = [int(c) for c in cap]
        self.enabled = tuple(s.enable_prefix_caching for s in specs)
        self.exact = [False] * len(specs)
        self.overflowed = [0] * len(specs)
        # per instance: key -> copies held (exact mode; 1 in approximate mode), oldest first
        self._blocks: list[OrderedDict[int, int]] = [OrderedDict() for _ in specs]

    def __len__(self) -> int:
        return len(self._blocks)

    def sizes(self) -> IntArray:
        """Blocks indexed per instance."""
        return np.fromiter((len(b) for b in self._blocks), dtype=np.int64,
                           count=len(self._blocks))

    def set_exact(self, g: int, exact: bool = True, block_size: int | None = None,
                  capacity: int | None = None) -> None:
        """Put instance g's index in exact mode (fed by its engine's events) or back in
        approximate mode; either way it starts empty. ``block_size``/``capacity``: the
        engine's own, where it says them (exact mode only)."""
        self.exact[g] = exact
        self.block_sizes[g] = block_size if exact and block_size else self.block_size
        if capacity is not None:
            self.capacity[g] = int(capacity)
        self._blocks[g].clear()

    def match(self, hashes: IntArray | None, prompt_tokens: int,
              engine_hashes: Sequence[IntArray | None] | None = None) -> PrefixMatch:
        """The longest indexed prefix of the prompt on every instance, in blocks and in
        tokens (at most ``prompt_tokens - 1``, in whole blocks): of ``hashes``, or on an
        exact instance of ``engine_hashes[g]`` where given. Reading refreshes nothing."""
        n = len(self._blocks)
        matched = np.zeros(n, dtype=np.int64)
        approx = self._keys(hashes, prompt_tokens, self.block_size)
        for g in range(n):
            if self.exact[g]:
                own = hashes if engine_hashes is None or engine_hashes[g] is None \
                    else engine_hashes[g]
                keys = self._keys(own, prompt_tokens, self.block_sizes[g])
                matched[g] = _walk(self._blocks[g], keys)
            else:
                matched[g] = self._depth(g, approx)
        return PrefixMatch(cached_tokens=matched * np.asarray(self.block_sizes,
                                                               dtype=np.int64),
                           matched_blocks=matched,
                           request_blocks=0 if hashes is None else len(hashes),
                           index_blocks=self.sizes())

    def cached_on(self, g: int, hashes: IntArray | None, prompt_tokens: int) -> int:
        """``match``'s cached tokens on instance g alone, of ``hashes`` (the names g's
        index uses)."""
        bs = self.block_sizes[g]
        keys = self._keys(hashes, prompt_tokens, bs)
        return (_walk(self._blocks[g], keys) if self.exact[g] else self._depth(g, keys)) * bs

    def sent(self, g: int, hashes: IntArray | None, prompt_tokens: int) -> int:
        """A request of ``prompt_tokens`` with these hashes was sent to instance g: its
        prompt tokens the index expected cached there (``cached_on``), then, in
        approximate mode, recorded there (``routed``)."""
        cached = self.cached_on(g, hashes, prompt_tokens)
        self.routed(g, hashes)
        return cached

    @staticmethod
    def _keys(hashes: IntArray | None, prompt_tokens: int, block_size: int) -> list[int]:
        """The hashes a match may count: at most ``prompt_tokens - 1`` tokens of blocks."""
        if hashes is None:
            return []
        keys: list[int] = hashes[:max(prompt_tokens - 1, 0) // block_size].tolist()
        return keys

    def _depth(self, g: int, keys: list[int]) -> int:
        """How many of ``keys`` from the front instance g's approximate index holds."""
        blocks = self._blocks[g]
        return _longest(blocks, keys) if keys and keys[0] in blocks else 0

    def routed(self, g: int, hashes: IntArray | None) -> None:
        """A request with these block hashes went to instance g: in approximate mode its
        blocks become g's most recent (the first block most of all), and g forgets its
        least recent blocks beyond its capacity. Exact mode records nothing: only the
        engine's events do."""
        if hashes is None or len(hashes) == 0 or not self.enabled[g] or self.exact[g]:
            return
        blocks = self._blocks[g]
        cap = self.capacity[g]
        for h in reversed(hashes.tolist()):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = 1
        while len(blocks) > cap:
            blocks.popitem(last=False)

    def stored(self, g: int, keys: Iterable[int]) -> None:
        """Instance g's engine registered blocks with these keys (exact mode): one copy
        more of each, its key the most recent."""
        blocks = self._blocks[g]
        for k in keys:
            blocks[k] = blocks.get(k, 0) + 1
            blocks.move_to_end(k)
        cap = self.capacity[g]
        while len(blocks) > cap:
            blocks.popitem(last=False)
            self.overflowed[g] += 1

    def removed(self, g: int, keys: Iterable[int]) -> None:
        """Instance g's engine dropped blocks with these keys (exact mode): one copy
        less of each, the key gone with its last copy; a key not held is ignored."""
        blocks = self._blocks[g]
        for k in keys:
            n = blocks.get(k)
            if n is None:
                continue
            if n > 1:
                blocks[k] = n - 1
            else:
                del blocks[k]

    def copies(self, g: int) -> dict[int, int]:
        """Per key instance g's index holds, the copies of it held (1 in approximate
        mode; for tests and audits)."""
        return dict(self._blocks[g])

    def holds(self, g: int) -> set[int]:
        """The keys instance g's index holds (for tests and audits)."""
        return set(self._blocks[g])

    def clear(self, g: int) -> None:
        """Instance g lost its cache (it restarted, was marked down, or its engine said
        so)."""
        self._blocks[g].clear()


def _walk(blocks: OrderedDict[int, int], keys: list[int]) -> int:
    """How many of ``keys`` from the front are in ``blocks``, stopping at the first
    missing one."""
    n = 0
    for k in keys:
        if k not in blocks:
            break
        n += 1
    return n


def _longest(blocks: OrderedDict[int, int], keys: list[int]) -> int:
    """How many of ``keys`` from the front are in ``blocks``, given that what is there
    is a prefix of them (``keys[0]`` is)."""
    lo, hi = 1, len(keys)      # keys[:lo] are in; keys[hi:] are not known to be
    if keys[hi - 1] in blocks:
        return hi
    hi -= 1
    while lo < hi:             # keys[lo - 1] in, keys[hi] out
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
