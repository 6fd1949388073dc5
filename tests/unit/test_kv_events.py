"""vLLM's KV events on the wire (olproute.routing.kv_events) and its block hashes
(olproute.routing.block_hash), against frames and hashes recorded from a real vLLM CPU
server (tests/data/kv_events, written by tests/support/record_kv_events.py in vLLM's own
virtualenv with vLLM's own hash functions); and the prefix index's exact mode."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from olproute.routing.block_hash import (
    BlockHasher,
    HfTokenizer,
    PromptNamer,
    WordTokenizer,
    load_tokenizer,
)
from olproute.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventsError,
    block_key,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
    seq_of,
)
from olproute.routing.prefix_index import PrefixIndex
from olproute.types import InstanceSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "kv_events"
FIXTURES = sorted(DATA.glob("vllm-*.json"))
MASK_63 = (1 << 63) - 1


def _fixture(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _frames(doc: dict[str, Any], source: str) -> list[tuple[int, bytes]]:
    return [(f["seq"], base64.b64decode(f["payload_b64"])) for f in doc["frames"]
            if f["source"] == source and f["seq"] >= 0]


def test_the_recorded_fixtures_are_there() -> None:
    algos = {_fixture(p)["hash_algo"] for p in FIXTURES}
    assert {"sha256", "sha256_cbor"} <= algos


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_every_recorded_message_decodes(path: Path) -> None:
    doc = _fixture(path)
    for f in doc["frames"]:
        if f["seq"] < 0:
            continue
        topic = base64.b64decode(f["topic_b64"])
        frames = [topic, f["seq"].to_bytes(8, "big"), base64.b64decode(f["payload_b64"])]
        got_topic, seq, batch = decode_message(frames)
        assert (got_topic, seq) == (b"kv-events", f["seq"])
        assert batch.events and all(isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared)
                                    for e in batch.events)
        assert batch.data_parallel_rank == 0


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_the_hasher_reproduces_vllms_block_hashes(path: Path) -> None:
    doc = _fixture(path)
    hasher = BlockHasher(doc["hash_algo"], doc["none_hash_seed"])
    assert hasher.none_hash.hex() == doc["none_hash_hex"]
    checked = 0
    for r in doc["requests"]:
        if not r.get("token_ids"):
            continue
        keys = hasher.keys(r["token_ids"], doc["block_size"]).tolist()
        assert keys == [h & MASK_63 for h in r["expected_block_hashes_int64"]], r["label"]
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_stored_events_carry_the_hashes_of_their_token_ids(path: Path) -> None:
    """A BlockStored's hashes follow from its token ids and parent: the router's self
    check of an engine's hash setting."""
    doc = _fixture(path)
    hasher = BlockHasher(doc["hash_algo"], doc["none_hash_seed"])
    bs = doc["block_size"]
    seen = 0
    for _, payload in _frames(doc, "pub"):
        for e in decode_batch(payload).events:
            if isinstance(e, BlockStored) and e.parent_block_hash is None:
                assert hasher.keys(e.token_ids, bs).tolist() == \
                    [block_key(h) for h in e.block_hashes]
                seen += 1
    assert seen >= 5


def _spec(name: str, blocks: int = 1000, block_size: int = 32) -> InstanceSpec:
    return InstanceSpec(name=name, model="m", gpu="g", tensor_parallel=1,
                        num_kv_blocks=blocks,
                        block_size=block_size, max_num_seqs=8, max_num_batched_tokens=512,
                        enable_prefix_caching=True)


def _apply(index: PrefixIndex, g: int, payload: bytes) -> None:
    for e in decode_batch(payload).events:
        if isinstance(e, BlockStored):
            index.stored(g, (block_key(h) for h in e.block_hashes))
        elif isinstance(e, BlockRemoved):
            index.removed(g, (block_key(h) for h in e.block_hashes))
        else:
            index.clear(g)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_an_exact_index_fed_the_recorded_stream_finds_what_the_engine_held(path: Path) -> None:
    doc = _fixture(path)
    hasher = BlockHasher(doc["hash_algo"], doc["none_hash_seed"])
    bs = doc["block_size"]
    index = PrefixIndex([_spec("e", blocks=doc["num_gpu_blocks_override"], block_size=bs)])
    index.set_exact(0, block_size=bs)
    keys = {r["label"]: hasher.keys(r["token_ids"], bs) for r in doc["requests"]
            if r.get("token_ids")}
    by_seq = dict(_frames(doc, "pub"))
    a = keys["A: 2 blocks, new"]
    c4 = next(v for k, v in keys.items() if k.startswith("C4"))
    for seq in sorted(by_seq):
        _apply(index, 0, by_seq[seq])
        if seq == 0:   # A's two blocks registered: a longer prompt finds both
            assert index.cached_on(0, a, 10_000) == 2 * bs
        if seq == 9:   # four prompts of four new blocks each later, A is evicted
            assert index.cached_on(0, a, 10_000) == 0
            assert index.cached_on(0, c4, 10_000) == 4 * bs
    # the cache reset, then A again: A's blocks alone
    assert index.holds(0) == set(a.tolist())


def test_the_replay_socket_returned_what_was_published() -> None:
    doc = _fixture(FIXTURES[0])
    pub = _frames(doc, "pub")
    replayed = [f for f in _frames(doc, "replay")][:len(pub)]
    assert replayed == pub


@pytest.mark.parametrize("junk", [b"", b"\x00", b"\x93\x01\x02\x03", b"not msgpack at all",
                                  encode_batch([], ts=1.0)[:-3]])
def test_a_malformed_payload_is_a_clear_error(junk: bytes) -> None:
    with pytest.raises(KvEventsError, match="not a KV event batch"):
        decode_batch(junk)


def test_an_unknown_event_type_and_bad_frames_are_clear_errors() -> None:
    import msgspec

    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}], 0])
    with pytest.raises(KvEventsError, match="BlockMoved"):
        decode_batch(payload)
    with pytest.raises(KvEventsError, match="2 frames"):
        decode_message([b"t", b"x"])
    with pytest.raises(KvEventsError, match="sequence frame of 3 bytes"):
        seq_of(b"abc")
    with pytest.raises(KvEventsError, match="type str"):
        block_key("abc")  # type: ignore[arg-type]


def test_fields_a_newer_vllm_adds_are_ignored() -> None:
    import msgspec

    payload = msgspec.msgpack.encode([2.0, [{
        "type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
        "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
        "lora_name": None, "group_idx": 0, "some_future_field": [1, 2]}], 0])
    (e,) = decode_batch(payload).events
    assert isinstance(e, BlockStored) and e.block_hashes == [5]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=4),
       st.lists(st.integers(0, (1 << 64) - 1), max_size=4), st.integers(0, (1 << 63) - 1))
def test_encode_then_decode_is_the_identity(hashes: list[bytes], removed: list[int],
                                            seq: int) -> None:
    events = [BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                          token_ids=list(range(len(hashes))), block_size=1, lora_id=None,
                          medium="GPU", lora_name=None),
              BlockRemoved(block_hashes=list(removed), medium="GPU"), AllBlocksCleared()]
    frames = encode_message("kv-events", seq, encode_batch(events, ts=3.5,
                                                          data_parallel_rank=0))
    topic, got_seq, batch = decode_message(frames)
    assert (topic, got_seq, batch.ts, batch.events) == (b"kv-events", seq, 3.5, events)


def test_block_key_agrees_for_the_bytes_and_int_forms() -> None:
    h = bytes(range(32))
    as_int = int.from_bytes(h, "big") & ((1 << 64) - 1)   # vLLM's int form
    assert block_key(h) == block_key(as_int) == as_int & MASK_63


def test_hash_settings_the_router_cannot_match_are_refused() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher("xxhash")
    assert BlockHasher("sha256", "123").none_hash != BlockHasher("sha256").none_hash


def test_a_word_tokenizer_gives_one_stable_id_per_word() -> None:
    tok = WordTokenizer()
    ids = tok.encode("a b  a\nc")
    assert len(ids) == 4 and ids[0] == ids[2] and len(set(ids)) == 3
    assert ids == WordTokenizer().encode("a b a c")
    assert load_tokenizer("words").encode("x y") == tok.encode("x y")


def _tokenizer_folder(root: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", ":", "hi",
                                         "there", "assistant"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}))
    return root


def test_a_tokenizer_folder_encodes_prompts_and_chats(tmp_path: Path) -> None:
    tok = HfTokenizer(_tokenizer_folder(tmp_path / "tok"))
    assert tok.encode("hi there hi") == [5, 6, 5]
    assert tok.encode_chat([{"role": "user", "content": "hi there"}]) == [3, 4, 5, 6, 7, 4]
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        HfTokenizer(tmp_path)


def test_a_namer_hashes_text_ids_or_chat(tmp_path: Path) -> None:
    namer = PromptNamer(HfTokenizer(_tokenizer_folder(tmp_path / "tok")),
                        BlockHasher("sha256_cbor"), block_size=2)
    by_text = namer.keys("hi there hi there hi")
    by_ids = namer.keys(None, [5, 6, 5, 6, 5])
    assert by_text is not None and by_ids is not None
    assert by_text.tolist() == by_ids.tolist() and len(by_text) == 2
    assert namer.keys(None) is None
    chat = namer.keys(None, chat=[{"role": "user", "content": "hi"}])
    assert chat is not None and len(chat) == 2   # user : hi assistant : = 5 tokens


def test_exact_mode_records_only_the_engines_word() -> None:
    index = PrefixIndex([_spec("a"), _spec("b")])
    index.set_exact(1, block_size=64)
    h = np.array([11, 12, 13], dtype=np.int64)
    index.routed(0, h)
    index.routed(1, h)
    assert index.sizes().tolist() == [3, 0]
    index.stored(1, [11, 12])
    m = index.match(h, 10_000)
    assert m.matched_blocks.tolist() == [3, 2]
    assert m.cached_tokens.tolist() == [3 * 32, 2 * 64]


def test_an_exact_match_stops_at_the_first_block_the_engine_lacks() -> None:
    index = PrefixIndex([_spec("a")])
    index.set_exact(0)
    index.stored(0, [1, 2, 3, 4])
    index.removed(0, [2])
    assert index.cached_on(0, np.array([1, 2, 3, 4], dtype=np.int64), 10_000) == 32
    index.removed(0, [1])
    assert index.cached_on(0, np.array([1, 2, 3, 4], dtype=np.int64), 10_000) == 0


def test_exact_instances_match_their_own_names_of_the_prompt() -> None:
    index = PrefixIndex([_spec("a"), _spec("b")])
    index.set_exact(1)
    approx = np.array([1, 2], dtype=np.int64)
    engine = np.array([901, 902], dtype=np.int64)
    index.routed(0, approx)
    index.stored(1, [901, 902])
    m = index.match(approx, 10_000, engine_hashes=(None, engine))
    assert m.matched_blocks.tolist() == [2, 2]
    assert index.match(approx, 10_000).matched_blocks.tolist() == [2, 0]


def test_an_exact_index_is_bounded_and_counts_what_it_dropped() -> None:
    index = PrefixIndex([_spec("a", blocks=3)])
    index.set_exact(0)
    index.stored(0, [1, 2, 3, 4, 5])
    assert index.holds(0) == {3, 4, 5} and index.overflowed == [2]
    index.set_exact(0, exact=False)
    assert index.sizes().tolist() == [0] and not index.exact[0]


def test_an_exact_index_counts_copies_of_a_block() -> None:
    """vLLM does not deduplicate: two copies of a block stored, one evicted, the block is
    still held and matched; the last copy's eviction drops it."""
    index = PrefixIndex([_spec("a")])
    index.set_exact(0)
    h = np.array([1, 2], dtype=np.int64)
    index.stored(0, [1, 2])
    index.stored(0, [2])
    assert index.copies(0) == {1: 1, 2: 2} and index.sizes().tolist() == [2]
    index.removed(0, [2])
    assert index.holds(0) == {1, 2} and index.cached_on(0, h, 10_000) == 2 * 32
    index.removed(0, [2, 2, 7])     # the last copy, then keys not held: ignored
    assert index.holds(0) == {1} and index.cached_on(0, h, 10_000) == 32
    index.stored(0, [2])
    assert index.copies(0) == {1: 1, 2: 1}
    index.clear(0)
    assert index.holds(0) == set()
