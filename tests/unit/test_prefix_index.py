"""The router's names for prompt prefixes (``text_block_hashes``: chained hashes of blocks
of whitespace words, the same on the router's and the emulator's side of a body) and its
per-instance prefix index (``PrefixIndex``: an LRU of routed blocks, prefix-closed,
bounded by each instance's KV blocks)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from olproute.emulator.lengths import chat_text
from olproute.emulator.protocol import parse_request
from olproute.routing.prefix_index import PrefixIndex, id_block_hashes, text_block_hashes
from olproute.server.schema import ChatBody, CompletionBody, prompt_tokens_of, validate
from olproute.types import InstanceSpec

IntArray = np.ndarray[Any, np.dtype[np.int64]]


def _words(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def _text(words: list[str]) -> str:
    return " ".join(words)


# -- hashing --------------------------------------------------------------------------------
def test_equal_prefixes_give_equal_leading_hashes() -> None:
    a = _words(70)
    b = a[:48] + _words(40, "other")
    ha, hb = text_block_hashes(_text(a), 16), text_block_hashes(_text(b), 16)
    assert len(ha) == 4 and len(hb) == 5
    assert ha[:3].tolist() == hb[:3].tolist()
    assert ha[3] != hb[3]


@pytest.mark.parametrize("changed", [0, 17, 40, 63])
def test_a_changed_word_changes_its_block_and_every_one_after(changed: int) -> None:
    words = _words(64)
    other = list(words)
    other[changed] = "changed"
    h, g = text_block_hashes(_text(words), 16), text_block_hashes(_text(other), 16)
    block = changed // 16
    assert h[:block].tolist() == g[:block].tolist()
    assert all(x != y for x, y in zip(h[block:].tolist(), g[block:].tolist(), strict=True))


def test_a_block_hash_names_its_whole_prefix() -> None:
    """Equal second blocks after different first blocks hash differently."""
    tail = _words(16, "t")
    h = text_block_hashes(_text(_words(16, "a") + tail), 16)
    g = text_block_hashes(_text(_words(16, "b") + tail), 16)
    assert h[1] != g[1]


@pytest.mark.parametrize(("num_words", "block_size", "expected"),
                         [(0, 16, 0), (15, 16, 0), (16, 16, 1), (47, 16, 2), (48, 16, 3),
                          (5, 1, 5), (9, 4, 2)])
def test_only_full_blocks_are_hashed(num_words: int, block_size: int, expected: int) -> None:
    h = text_block_hashes(_text(_words(num_words)), block_size)
    assert len(h) == expected
    assert h.dtype == np.int64 and not h.flags.writeable
    assert (h >= 0).all()


def test_a_partial_last_block_leaves_the_full_ones_alone() -> None:
    words = _words(40)
    assert (text_block_hashes(_text(words), 16).tolist()
            == text_block_hashes(_text(words[:32]), 16).tolist())


def test_whitespace_between_words_plays_no_part() -> None:
    words = _words(32)
    assert (text_block_hashes("  " + "\n\t ".join(words) + "\n", 16).tolist()
            == text_block_hashes(_text(words), 16).tolist())


def test_max_blocks_caps_the_hashes() -> None:
    text = _text(_words(64))
    full = text_block_hashes(text, 16)
    assert text_block_hashes(text, 16, 2).tolist() == full[:2].tolist()
    assert len(text_block_hashes(text, 16, 0)) == 0
    assert text_block_hashes(text, 16, 99).tolist() == full.tolist()


def test_hashes_are_stable_values() -> None:
    """The same in every process and release: the first two blocks of a fixed text."""
    h = text_block_hashes("alpha beta gamma delta epsilon zeta", 3)
    assert h.tolist() == text_block_hashes("alpha beta gamma delta epsilon zeta", 3).tolist()
    assert h.tolist() == [_expected(["alpha beta gamma", "delta epsilon zeta"])[i]
                          for i in range(2)]


def _expected(blocks: list[str]) -> list[int]:
    """The documented chain, written out."""
    from hashlib import blake2b

    out, d = [], b"\xff" * 8
    for b in blocks:
        d = blake2b(d + b.encode(), digest_size=8).digest()
        out.append(int.from_bytes(d, "little") & ((1 << 63) - 1))
    return out


def test_non_ascii_and_lone_surrogates_hash() -> None:
    h = text_block_hashes("café naïve \ud800 日本 語", 2)
    assert len(h) == 2


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        text_block_hashes("a b", 0)


# -- the same text on both sides -------------------------------------------------------------
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "one two three four five"}],
    [{"role": "system", "content": "you are terse"},
     {"role": "user", "content": "say six seven eight nine ten"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "text", "text": "part two  three"}]},
     {"role": "assistant", "content": None},
     {"role": "user", "content": ""},
     {"role": "user", "content": "last\nwords\there"}],
]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_chat_text_is_the_same_words_on_both_sides(messages: list[dict[str, Any]],
                                                   block_size: int) -> None:
    """The router's count and text of a chat body (``prompt_tokens_of``) and the
    emulator's (``parse_request``; and the lengths' prompt key text) are the same words,
    so both give the same block hashes."""
    body = {"model": "m", "messages": messages}
    tokens, text = prompt_tokens_of(validate(ChatBody, body))
    gen = parse_request(body, "chat", "m", 10_000)
    assert text is not None and gen.prompt_text is not None
    assert tokens == gen.prompt_tokens == len(text.split())
    assert text.split() == gen.prompt_text.split() == chat_text(messages).split()
    assert (text_block_hashes(text, block_size).tolist()
            == text_block_hashes(gen.prompt_text, block_size).tolist())


def test_completion_text_is_the_same_on_both_sides() -> None:
    body = {"model": "m", "prompt": "a b c d e f g"}
    tokens, text = prompt_tokens_of(validate(CompletionBody, body))
    gen = parse_request(body, "completion", "m", 10_000)
    assert (tokens, text) == (gen.prompt_tokens, gen.prompt_text)
    batch = parse_request({"model": "m", "prompt": ["a b c"]}, "completion", "m", 10_000)
    assert batch.prompt_text == "a b c"
    ids = parse_request({"model": "m", "prompt": [1, 2, 3]}, "completion", "m", 10_000)
    assert ids.prompt_text is None


# -- the index ----------------------------------------------------------------------------------
def _spec(name: str, blocks: int = 100, caching: bool = True,
          block_size: int = 4) -> InstanceSpec:
    return InstanceSpec(name=name, model="m", gpu="g", tensor_parallel=1, max_num_seqs=8,
                        max_num_batched_tokens=512, block_size=block_size,
                        num_kv_blocks=blocks, enable_prefix_caching=caching)


def _chain(*ids: int) -> IntArray:
    return np.array(ids, dtype=np.int64)


def test_a_routed_prompt_matches_on_its_instance_only() -> None:
    index = PrefixIndex([_spec("a"), _spec("b")])
    h = _chain(1, 2, 3)
    index.routed(0, h)
    m = index.match(h, 13)
    assert m.matched_blocks.tolist() == [3, 0]
    assert m.cached_tokens.tolist() == [12, 0]
    assert m.request_blocks == 3 and m.index_blocks.tolist() == [3, 0]
    assert m.hit_fraction.tolist() == [1.0, 0.0]
    # a prompt sharing the first two blocks
    assert index.match(_chain(1, 2, 9), 13).matched_blocks.tolist() == [2, 0]


@pytest.mark.parametrize(("prompt_tokens", "expected"), [(13, 3), (12, 2), (9, 2), (8, 1),
                                                         (1, 0)])
def test_match_leaves_the_last_prompt_token_to_compute(prompt_tokens: int,
                                                       expected: int) -> None:
    """At most ``prompt_tokens - 1`` tokens in whole blocks, as vLLM computes a prompt's
    last token again."""
    index = PrefixIndex([_spec("a")])
    h = _chain(1, 2, 3)
    index.routed(0, h)
    assert index.match(h, prompt_tokens).matched_blocks.tolist() == [expected]


def test_no_hashes_match_nothing() -> None:
    index = PrefixIndex([_spec("a")])
    index.routed(0, _chain(1, 2))
    m = index.match(None, 100)
    assert m.matched_blocks.tolist() == [0] and m.request_blocks == 0
    assert m.hit_fraction.tolist() == [0.0]
    index.routed(0, None)
    index.routed(0, _chain())
    assert index.sizes().tolist() == [2]


def test_capacity_forgets_the_least_recently_routed() -> None:
    index = PrefixIndex([_spec("a")], capacity=[4])
    index.routed(0, _chain(1, 2))
    index.routed(0, _chain(10, 11))
    index.routed(0, _chain(1, 2))      # refreshed: now the most recent
    index.routed(0, _chain(20, 21))    # evicts 10, 11
    assert index.sizes().tolist() == [4]
    assert index.match(_chain(10, 11), 100).matched_blocks.tolist() == [0]
    assert index.match(_chain(1, 2), 100).matched_blocks.tolist() == [2]
    assert index.match(_chain(20, 21), 100).matched_blocks.tolist() == [2]


def test_what_stays_of_a_chain_after_evictions_is_a_prefix() -> None:
    """A chain evicted in part keeps its first blocks (recorded last, so youngest), and
    match finds exactly them."""
    index = PrefixIndex([_spec("a")], capacity=[5])
    index.routed(0, _chain(1, 2, 3, 4))
    index.routed(0, _chain(7, 8, 9))   # 4 and 3 go first, the chain's tail
    assert index.match(_chain(1, 2, 3, 4), 100).matched_blocks.tolist() == [2]
    index.routed(0, _chain(1, 2, 5))   # refreshes the prefix, adds a branch
    assert index.match(_chain(1, 2, 5), 100).matched_blocks.tolist() == [3]
    assert index.match(_chain(7, 8, 9), 100).matched_blocks.tolist() == [2]  # 9 went


def test_many_chains_stay_prefix_closed_under_eviction() -> None:
    """Random prompts from a few shared prefixes through a small index: every chain's
    indexed blocks are always a prefix of it, and match counts exactly them."""
    rng = np.random.default_rng(3)
    index = PrefixIndex([_spec("a")], capacity=[12])
    chains = [[int(x) for x in rng.integers(0, 1 << 40, 8)] for _ in range(4)]
    for _ in range(300):
        c = chains[int(rng.integers(len(chains)))]
        n = int(rng.integers(1, 9))
        # a prompt of n blocks sharing the chain's first k, then its own
        k = int(rng.integers(0, n + 1))
        own = [int(x) for x in rng.integers(1 << 41, 1 << 42, n - k)]
        index.routed(0, np.array(c[:k] + own, dtype=np.int64))
        blocks = index._blocks[0]
        for chain in chains:
            present = [h in blocks for h in chain]
            depth = present.index(False) if False in present else len(chain)
            assert not any(present[depth:]), "an indexed chain has a gap"
            found = index.match(np.array(chain, dtype=np.int64), 1000)
            assert found.matched_blocks.tolist() == [depth]
            # what one instance's lookup gives, as the proxy asks it at a dispatch
            for prompt in (1000, 16 * depth, 17):
                on = index.cached_on(0, np.array(chain, dtype=np.int64), prompt)
                assert on == index.match(np.array(chain, dtype=np.int64),
                                         prompt).cached_tokens[0]
        assert len(blocks) <= 12


def test_clear_forgets_one_instance() -> None:
    index = PrefixIndex([_spec("a"), _spec("b")])
    h = _chain(1, 2)
    index.routed(0, h)
    index.routed(1, h)
    index.clear(0)
    assert index.match(h, 100).matched_blocks.tolist() == [0, 2]
    assert index.sizes().tolist() == [0, 2]


def test_an_instance_without_prefix_caching_indexes_nothing() -> None:
    index = PrefixIndex([_spec("a", caching=False), _spec("b")])
    h = _chain(1, 2)
    index.routed(0, h)
    index.routed(1, h)
    assert index.sizes().tolist() == [0, 2]
    assert index.match(h, 100).matched_blocks.tolist() == [0, 2]


def test_capacity_defaults_to_each_instances_kv_blocks_and_is_checked() -> None:
    assert PrefixIndex([_spec("a", 7), _spec("b", 9)]).capacity == [7, 9]
    with pytest.raises(ValueError, match="one non-negative count"):
        PrefixIndex([_spec("a")], capacity=[1, 2])
    with pytest.raises(ValueError, match="one block size"):
        PrefixIndex([_spec("a", block_size=4), _spec("b", block_size=8)])


def test_token_id_prompts_hash_by_blocks_of_ids_in_their_own_space() -> None:
    """Token-id prompts: equal leading blocks give equal hashes, a changed id changes its
    block and every one after, a partial block has none, and no id prompt shares a hash
    with the text of the same numbers."""
    ids = list(range(100, 164))                       # 4 blocks of 16
    same = id_block_hashes([*ids[:48], *[7] * 16], 16)
    full = id_block_hashes(ids, 16)
    assert len(full) == 4 and full.dtype == np.int64 and (full >= 0).all()
    assert same[:3].tolist() == full[:3].tolist() and same[3] != full[3]
    changed = id_block_hashes([99, *ids[1:]], 16)
    assert not set(changed.tolist()) & set(full.tolist())
    assert id_block_hashes([*ids, 1, 2, 3], 16).tolist() == full.tolist()
    assert id_block_hashes(ids, 16, max_blocks=2).tolist() == full[:2].tolist()
    assert len(id_block_hashes(ids[:15], 16)) == 0
    text = text_block_hashes(" ".join(str(i) for i in ids), 16)
    assert not set(text.tolist()) & set(full.tolist())


def test_an_id_past_64_bits_hashes_by_its_low_64_bits() -> None:
    """The server forwards integers past 64 bits for the backend to judge; hashing such
    a prompt must not fail (its low 64 bits stand for it)."""
    big = [2**63 + 5, 2**70, *range(30)]
    low = [(2**63 + 5) & (2**64 - 1), 0, *range(30)]
    assert id_block_hashes(big, 16).tolist() == id_block_hashes(low, 16).tolist()
    assert len(id_block_hashes(big, 16)) == 2
