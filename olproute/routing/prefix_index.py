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
BlockRemoved / AllBlocksCleared per engine, over ZMQ), an exact view would replace
``routed`` and the LRU ageing with ``stored`` / ``removed`` calls from a subscriber per
backend; ``match`` and what the policies read would stay as they are.
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
    """Per instance, an LRU set of the block hashes routed there, bounded by the
    instance's KV blocks (``capacity``; default each spec's ``num_kv_blocks``). Instances
    without prefix caching index nothing and match nothing."""

    __slots__ = ("_blocks", "block_size", "capacity", "enabled")

    def __init__(self, specs: Sequence[InstanceSpec],
                 capacity: Sequence[int] | None = None) -> None:
        sizes = {s.block_size for s in specs}
        if len(sizes) > 1:
            raise ValueError(f"the prefix index needs one block size, the instances have "
                             f"{sorted(sizes)}")
        self.block_size = sizes.pop() if sizes else 16
        cap = [s.num_kv_blocks for s in specs] if capacity is None else list(capacity)
        if len(cap) != len(specs) or any(c < 0 for c in cap):
            raise ValueError("capacity needs one non-negative count per instance")
        self.capacity = tuple(int(c) for c in cap)
        self.enabled = tuple(s.enable_prefix_caching for s in specs)
        self._blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in specs]

    def __len__(self) -> int:
        return len(self._blocks)

    def sizes(self) -> IntArray:
        """Blocks indexed per instance."""
        return np.fromiter((len(b) for b in self._blocks), dtype=np.int64,
                           count=len(self._blocks))

    def match(self, hashes: IntArray | None, prompt_tokens: int) -> PrefixMatch:
        """The longest indexed prefix of ``hashes`` on every instance, in blocks and in
        tokens (at most ``prompt_tokens - 1``, in whole blocks). Reading does not
        refresh anything: only routing does."""
        keys = self._keys(hashes, prompt_tokens)
        matched = np.fromiter((self._depth(g, keys) for g in range(len(self._blocks))),
                              dtype=np.int64, count=len(self._blocks))
        return PrefixMatch(cached_tokens=matched * self.block_size, matched_blocks=matched,
                           request_blocks=0 if hashes is None else len(hashes),
                           index_blocks=self.sizes())

    def cached_on(self, g: int, hashes: IntArray | None, prompt_tokens: int) -> int:
        """``match``'s cached tokens on instance g alone."""
        return self._depth(g, self._keys(hashes, prompt_tokens)) * self.block_size

    def sent(self, g: int, hashes: IntArray | None, prompt_tokens: int) -> int:
        """A request of ``prompt_tokens`` with these hashes was sent to instance g: its
        prompt tokens the index expected cached there (``cached_on``), then recorded
        there (``routed``)."""
        cached = self.cached_on(g, hashes, prompt_tokens)
        self.routed(g, hashes)
        return cached

    def _keys(self, hashes: IntArray | None, prompt_tokens: int) -> list[int]:
        """The hashes a match may count: at most ``prompt_tokens - 1`` tokens of blocks."""
        if hashes is None:
            return []
        keys: list[int] = hashes[:max(prompt_tokens - 1, 0) // self.block_size].tolist()
        return keys

    def _depth(self, g: int, keys: list[int]) -> int:
        """How many of ``keys`` from the front instance g's index holds."""
        blocks = self._blocks[g]
        return _longest(blocks, keys) if keys and keys[0] in blocks else 0

    def routed(self, g: int, hashes: IntArray | None) -> None:
        """A request with these block hashes went to instance g: its blocks become g's
        most recent (the first block most of all), and g forgets its least recent blocks
        beyond its capacity."""
        if hashes is None or len(hashes) == 0 or not self.enabled[g]:
            return
        blocks = self._blocks[g]
        cap = self.capacity[g]
        for h in reversed(hashes.tolist()):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > cap:
            blocks.popitem(last=False)

    def clear(self, g: int) -> None:
        """Instance g lost its cache (it restarted, or was marked down)."""
        self._blocks[g].clear()


def _longest(blocks: OrderedDict[int, None], keys: list[int]) -> int:
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
