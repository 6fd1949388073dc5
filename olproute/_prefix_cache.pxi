# Included by _core.pyx: the prefix cache's data structures and their nogil operations.
#
# vLLM v1's automatic prefix caching, kept in a form whose cost is zero for requests
# without hashes. vLLM keeps every free block in one queue, least recently freed first;
# a freed block that holds a full prompt block keeps its hash (and stays findable) until
# the allocator pops it from the front of the queue for a new use. Here only the blocks
# that carry a hash have an identity ("entries"); the free blocks without one are counted,
# as runs between entries: each entry in the free queue records how many unhashed free
# blocks sit just before it (``ent_gap``); those after the last entry are the rest of the
# unhashed free blocks, free blocks - evictable entries - the gaps (``_tail``), kept by
# the engine's free count alone. Popping n blocks from the front takes the head entry's
# gap, then the head entry itself (evicting its hash), and so on: the same blocks, in the
# same order, as vLLM's queue of block ids, which core_ref.ReferenceCore keeps literally.
# With no entry in the queue (every request without hashes) nothing here is touched.
#
# A hash maps to its entries in registration order (``ent_dup`` chains them): vLLM does not
# deduplicate, so two requests that prefill the same block at once both register it, and a
# lookup takes the first one still cached. The map itself is an open-addressing table
# (linear probing, backward-shift deletion) of at least twice as many slots as the engine
# has blocks, so it never fills: entries are physical blocks and never outnumber them.
#
# With KV events on (``BatchCore(kv_events=True)``), every entry made appends
# (KV_STORED, hash) to a bounded log and every entry evicted appends (KV_REMOVED, hash),
# in the order they happen, as vLLM's BlockStored / BlockRemoved; past the log's
# capacity events are counted, not kept. Off, the log is NULL and costs one test.

from libc.stdint cimport uint64_t

# Kinds of the KV-event log (BatchCore.take_kv_events).
cdef enum:
    EV_KV_STORED = 1
    EV_KV_REMOVED = 2

cdef struct PrefixCache:
    # per request slot, grown with the request table
    int64_t* num_hashes        # full prompt blocks with a hash, from the front
    int64_t* num_cached        # its first blocks held as entries (cache hits, registered)
    int64_t* cached_tokens     # prompt tokens found cached when first admitted
    int64_t** hashes           # its num_hashes hashes, then as many entry ids (NULL: none)
    # entries: the blocks that carry a hash, referenced by requests or free and evictable
    int64_t* ent_hash
    int64_t* ent_ref           # requests holding it; 0: in the free queue
    int64_t* ent_prev          # free queue, toward its front (-1: none)
    int64_t* ent_next          # free queue, toward its back; unused entries: the next one
    int64_t* ent_gap           # unhashed free blocks just before it in the free queue
    int64_t* ent_dup           # the next entry of the same hash, in registration order
    int64_t unused             # first unused entry id (-1: none)
    int64_t q_head             # free queue of entries: front (evicted first) and back
    int64_t q_tail
    int64_t sum_gaps           # the entries' gaps: unhashed free blocks before q_tail
    int64_t num_entries
    int64_t num_evictable
    int64_t num_hashed         # resident requests with hashes (0: nothing to register)
    # hash -> its first entry
    int64_t* tab_key           # -1: empty slot
    int64_t* tab_val
    int64_t tab_mask
    # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens, over admissions that
    # looked the cache up
    int64_t queries
    int64_t hits
    # KV-event log (NULL: off): kinds then hashes, kv_capacity of each
    int64_t* kv_log
    int64_t kv_capacity
    int64_t kv_len
    int64_t kv_dropped


cdef inline uint64_t _mix(int64_t key) noexcept nogil:
    """splitmix64's finaliser: sequential hashes spread over the table."""
    cdef uint64_t x = <uint64_t>key
    x = (x ^ (x >> 30)) * <uint64_t>0xbf58476d1ce4e5b9ULL
    x = (x ^ (x >> 27)) * <uint64_t>0x94d049bb133111ebULL
    return x ^ (x >> 31)


cdef inline int64_t _tab_find(PrefixCache* pc, int64_t key) noexcept nogil:
    """The table slot holding ``key``, or the empty slot where it would go."""
    cdef int64_t i = <int64_t>(_mix(key) & <uint64_t>pc.tab_mask)
    while pc.tab_key[i] != -1 and pc.tab_key[i] != key:
        i = (i + 1) & pc.tab_mask
    return i


cdef void _tab_delete(PrefixCache* pc, int64_t i) noexcept nogil:
    """Empty table slot i, shifting back the keys after it that probed past it."""
    cdef int64_t j = i, home
    while True:
        j = (j + 1) & pc.tab_mask
        if pc.tab_key[j] == -1:
            break
        home = <int64_t>(_mix(pc.tab_key[j]) & <uint64_t>pc.tab_mask)
        # the key at j stays if its home lies cyclically in (i, j]
        if i <= j:
            if i < home <= j:
                continue
        elif home > i or home <= j:
            continue
        pc.tab_key[i] = pc.tab_key[j]
        pc.tab_val[i] = pc.tab_val[j]
        i = j
    pc.tab_key[i] = -1


cdef inline int64_t _tail(PrefixCache* pc, int64_t free_blocks) noexcept nogil:
    """Unhashed free blocks behind the last entry of the free queue."""
    return free_blocks - pc.num_evictable - pc.sum_gaps


cdef inline void _queue_append(PrefixCache* pc, int64_t x, int64_t free_blocks) noexcept nogil:
    """Entry x (no longer referenced) goes to the back of the free queue; ``free_blocks``
    counts the free blocks before it joins."""
    pc.ent_gap[x] = _tail(pc, free_blocks)
    pc.sum_gaps += pc.ent_gap[x]
    pc.ent_prev[x] = pc.q_tail
    pc.ent_next[x] = -1
    if pc.q_tail >= 0:
        pc.ent_next[pc.q_tail] = x
    else:
        pc.q_head = x
    pc.q_tail = x
    pc.num_evictable += 1


cdef inline void _queue_remove(PrefixCache* pc, int64_t x) noexcept nogil:
    """Entry x leaves the free queue; the unhashed blocks before it now precede the next."""
    cdef int64_t p = pc.ent_prev[x], n = pc.ent_next[x]
    if n >= 0:
        pc.ent_gap[n] += pc.ent_gap[x]
        pc.ent_prev[n] = p
    else:
        pc.sum_gaps -= pc.ent_gap[x]  # they join the tail
        pc.q_tail = p
    if p >= 0:
        pc.ent_next[p] = n
    else:
        pc.q_head = n
    pc.num_evictable -= 1


cdef inline void _kv_event(PrefixCache* pc, int64_t kind, int64_t key) noexcept nogil:
    """Append (kind, key) to the KV-event log, or count it dropped when the log is
    full; nothing when the log is off."""
    if pc.kv_log == NULL:
        return
    if pc.kv_len < pc.kv_capacity:
        pc.kv_log[pc.kv_len] = kind
        pc.kv_log[pc.kv_capacity + pc.kv_len] = key
        pc.kv_len += 1
    else:
        pc.kv_dropped += 1


cdef int64_t _entry_new(PrefixCache* pc, int64_t key) noexcept nogil:
    """A new entry for ``key`` (referenced once), last in its hash's chain."""
    cdef int64_t x = pc.unused, i, p
    pc.unused = pc.ent_next[x]
    pc.num_entries += 1
    pc.ent_hash[x] = key
    pc.ent_ref[x] = 1
    pc.ent_prev[x] = -1
    pc.ent_next[x] = -1
    pc.ent_gap[x] = 0
    pc.ent_dup[x] = -1
    i = _tab_find(pc, key)
    if pc.tab_key[i] == -1:
        pc.tab_key[i] = key
        pc.tab_val[i] = x
    else:
        p = pc.tab_val[i]
        while pc.ent_dup[p] >= 0:
            p = pc.ent_dup[p]
        pc.ent_dup[p] = x
    _kv_event(pc, EV_KV_STORED, key)
    return x


cdef void _entry_forget(PrefixCache* pc, int64_t x) noexcept nogil:
    """Entry x's hash no longer finds it (evicted); x returns to the unused entries."""
    cdef int64_t i = _tab_find(pc, pc.ent_hash[x]), p
    _kv_event(pc, EV_KV_REMOVED, pc.ent_hash[x])
    if pc.tab_val[i] == x:
        if pc.ent_dup[x] >= 0:
            pc.tab_val[i] = pc.ent_dup[x]
        else:
            _tab_delete(pc, i)
    else:
        p = pc.tab_val[i]
        while pc.ent_dup[p] != x:
            p = pc.ent_dup[p]
        pc.ent_dup[p] = pc.ent_dup[x]
    pc.ent_next[x] = pc.unused
    pc.unused = x
    pc.num_entries -= 1


cdef void _pop_free(PrefixCache* pc, int64_t n) noexcept nogil:
    """Take n blocks from the front of the free queue (the caller checked they are free
    and counts them), evicting the entries among them; past the last entry, from the
    tail."""
    cdef int64_t x, g
    while n > 0:
        x = pc.q_head
        if x < 0:
            return
        g = pc.ent_gap[x]
        if g >= n:
            pc.ent_gap[x] = g - n
            pc.sum_gaps -= n
            return
        n -= g + 1
        pc.sum_gaps -= g
        pc.ent_gap[x] = 0
        _queue_remove(pc, x)
        _entry_forget(pc, x)


cdef int64_t _lookup(PrefixCache* pc, int64_t s, int64_t max_blocks,
                     int64_t* evictable) noexcept nogil:
    """Slot s's longest prefix of cached blocks, at most max_blocks: their entries are
    written to its entry ids; returns how many, and adds to ``evictable`` how many of them
    sit in the free queue (taking them takes free blocks, as vLLM counts it)."""
    cdef int64_t n = pc.num_hashes[s], i, k, x
    cdef int64_t* h = pc.hashes[s]
    if n > max_blocks:
        n = max_blocks
    for i in range(n):
        k = _tab_find(pc, h[i])
        if pc.tab_key[k] == -1:
            return i
        x = pc.tab_val[k]
        h[pc.num_hashes[s] + i] = x
        if pc.ent_ref[x] == 0:
            evictable[0] += 1
    return n


cdef int64_t _touch(PrefixCache* pc, int64_t s, int64_t n) noexcept nogil:
    """Slot s takes the n entries its lookup found (a reference each); returns how many
    of them left the free queue (the caller no longer counts them free)."""
    cdef int64_t i, x, taken = 0
    cdef int64_t* ids = pc.hashes[s] + pc.num_hashes[s]
    for i in range(n):
        x = ids[i]
        if pc.ent_ref[x] == 0:
            _queue_remove(pc, x)
            taken += 1
        pc.ent_ref[x] += 1
    pc.num_cached[s] = n
    return taken


cdef void _register(PrefixCache* pc, int64_t s, int64_t tokens,
                    int64_t block_size) noexcept nogil:
    """Slot s's full prompt blocks within its first ``tokens`` tokens (the computed ones
    and those of the batch being formed) enter the cache under their hashes."""
    cdef int64_t n = tokens // block_size, i
    cdef int64_t* h = pc.hashes[s]
    if n > pc.num_hashes[s]:
        n = pc.num_hashes[s]
    for i in range(pc.num_cached[s], n):
        h[pc.num_hashes[s] + i] = _entry_new(pc, h[i])
    if n > pc.num_cached[s]:
        pc.num_cached[s] = n


cdef int64_t _release(PrefixCache* pc, int64_t s, int64_t num_blocks,
                      int64_t free_blocks) noexcept nogil:
    """Slot s gives back its num_blocks blocks, last first (vLLM frees a request's blocks
    in reverse, so that a prompt's tail is evicted before its head): the unhashed ones
    (to the tail), then its entries, each joining the free queue when no other request
    holds it. ``free_blocks`` is the free count before; returns it after."""
    cdef int64_t c = pc.num_cached[s], i, x
    cdef int64_t* ids = pc.hashes[s] + pc.num_hashes[s]
    free_blocks += num_blocks - c
    for i in range(c - 1, -1, -1):
        x = ids[i]
        pc.ent_ref[x] -= 1
        if pc.ent_ref[x] == 0:
            _queue_append(pc, x, free_blocks)
            free_blocks += 1
    pc.num_cached[s] = 0
    return free_blocks
