# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Batch-formation kernel of a vLLM-v1-like engine (continuous batching, chunked prefill,
paged KV cache, preemption by recompute).

Kernels only, no policy. ``BatchCore`` owns one engine's request table as flat int64
arrays; ``schedule()`` forms one batch, ``commit()`` applies it once the batch has run.
The scheduling rules live in the ``cdef`` functions ``_schedule_impl`` and ``_commit``
that work on the ``Engine`` struct of raw pointers, so that the BEA replay (which copies a
snapshot into scratch arrays) reuses exactly the code the simulator's engines run.

With prefix caching on (vLLM v1's automatic prefix caching, ``_prefix_cache.pxi``), a
request may carry the hashes of its prompt's full blocks: when it is admitted its longest
cached prefix is taken and only the rest is prefilled, its full prompt blocks are
registered as they are scheduled, and freed blocks keep their hashes until evicted in
vLLM's order. A request without hashes costs what it did before: the free blocks without
a hash are only counted.

The plain-Python twin is ``olproute.core_ref.ReferenceCore``; tests assert both agree.
"""

import numpy as np
cimport numpy as cnp
from libc.math cimport INFINITY
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memmove

cnp.import_array()

include "_prefix_cache.pxi"

# Event flags written by _commit, one entry per scheduled request that produced a token.
cdef enum:
    EV_FIRST_TOKEN = 1
    EV_FINISHED = 2

FIRST_TOKEN = EV_FIRST_TOKEN
FINISHED = EV_FINISHED
# Kinds of the prefix cache's events (BatchCore.take_kv_events): vLLM's BlockStored and
# BlockRemoved, one per block.
KV_STORED = EV_KV_STORED
KV_REMOVED = EV_KV_REMOVED

# Indices of the batch sums vector (see BatchCore.schedule).
NUM_SUMS = 8

# Columns of a snapshot's table (olproute.types: SNAP_PROMPT, SNAP_OUTPUT, SNAP_PREDICTED,
# SNAP_COMPUTED, SNAP_BLOCKS).
cdef enum:
    SNAP_COLUMNS = 5


cdef struct Engine:
    # request table, indexed by slot
    int64_t* num_prompt      # prompt tokens
    int64_t* num_output      # output tokens generated so far
    int64_t* max_output      # output tokens at which the request finishes
    int64_t* num_computed    # tokens whose KV is in the cache
    int64_t* num_blocks      # KV blocks held
    int64_t* num_preempt     # times preempted
    # queues of slots, in priority order
    int64_t* running
    int64_t* waiting
    int64_t n_running
    int64_t n_waiting
    # capacity
    int64_t free_blocks
    int64_t total_blocks
    int64_t block_size
    int64_t max_num_seqs
    int64_t token_budget
    # last batch: scheduled slots, tokens, context before the batch, decode flag
    int64_t* sched_slot
    int64_t* sched_tokens
    int64_t* sched_ctx
    int64_t* sched_decode
    int64_t n_sched
    int64_t* preempted
    int64_t n_preempted
    # events of the last commit
    int64_t* ev_slot
    int64_t* ev_flags
    int64_t n_events
    double sums[8]
    # prefix cache (NULL: off, as in the BEA replay)
    PrefixCache* pc


cdef inline int64_t _blocks_for(int64_t tokens, int64_t block_size) noexcept nogil:
    return (tokens + block_size - 1) // block_size


cdef inline int64_t _extra_blocks(Engine* e, int64_t s, int64_t new) noexcept nogil:
    """Blocks slot s must add to hold computed + new tokens (no division when its last
    block still has room, the common case for a decoder)."""
    cdef int64_t tokens = e.num_computed[s] + new
    if tokens <= e.num_blocks[s] * e.block_size:
        return 0
    return _blocks_for(tokens, e.block_size) - e.num_blocks[s]


cdef inline bint _cache_active(Engine* e) noexcept nogil:
    """Does the prefix cache hold a block or a request with hashes? If not, it has nothing
    to look up, register, evict or release, and the engine only counts blocks."""
    return e.pc != NULL and (e.pc.num_hashed > 0 or e.pc.num_entries > 0)


cdef inline void _take_blocks(Engine* e, int64_t s, int64_t n, bint cache) noexcept nogil:
    """Slot s takes n new blocks (the caller checked they are free): from the front of
    the free queue, evicting the cached blocks among them (``cache``: the prefix cache
    is active)."""
    e.free_blocks -= n
    e.num_blocks[s] += n
    if cache and e.pc.q_head >= 0:
        _pop_free(e.pc, n)


cdef inline void _free_all(Engine* e, int64_t s, bint cache) noexcept nogil:
    """Slot s's blocks go back to the free pool (finished, preempted or aborted)."""
    if cache and e.pc.num_cached[s] > 0:
        e.free_blocks = _release(e.pc, s, e.num_blocks[s], e.free_blocks)
    else:
        e.free_blocks += e.num_blocks[s]
    e.num_blocks[s] = 0


cdef inline void _cache_scheduled(Engine* e, int64_t s, int64_t new) noexcept nogil:
    """Register slot s's prompt blocks that the batch being formed fills, as vLLM does
    when it allocates their slots (a later request of the same step may hit them: their
    KV is written before any attention of the batch reads it)."""
    if e.pc.num_cached[s] < e.pc.num_hashes[s]:
        _register(e.pc, s, e.num_computed[s] + new, e.block_size)


cdef inline int64_t _lookup_waiting(Engine* e, int64_t s, int64_t* evictable) noexcept nogil:
    """A waiting request with nothing computed starts after its longest cached prefix,
    tentatively (``_admit_cached`` takes it, or the caller undoes it); returns the number
    of cached blocks, -1 when no lookup applies. As vLLM, at least the last token is
    computed again: the prefix stops one token short of the request's known tokens."""
    cdef int64_t hit
    if e.num_computed[s] != 0 or e.pc.num_hashes[s] == 0:
        return -1
    hit = _lookup(e.pc, s, (e.num_prompt[s] + e.num_output[s] - 1) // e.block_size,
                  evictable)
    e.num_computed[s] = hit * e.block_size
    e.num_blocks[s] = hit
    return hit


cdef inline void _admit_cached(Engine* e, int64_t s, int64_t hit) noexcept nogil:
    """Slot s, admitted, holds the ``hit`` cached blocks of its lookup; the counters
    count its tokens and hits (its first admission's hits are its cached tokens)."""
    cdef PrefixCache* pc = e.pc
    e.free_blocks -= _touch(pc, s, hit)
    pc.queries += e.num_prompt[s] + e.num_output[s]
    pc.hits += hit * e.block_size
    if e.num_preempt[s] == 0:
        pc.cached_tokens[s] = hit * e.block_size


cdef inline void _record(Engine* e, int64_t s, int64_t new) noexcept nogil:
    """Append slot s with `new` tokens to the batch and update the batch sums."""
    cdef int64_t ctx = e.num_computed[s]
    cdef int64_t is_decode = 1 if (e.num_output[s] > 0
                                   and ctx == e.num_prompt[s] + e.num_output[s] - 1) else 0
    cdef int64_t k = e.n_sched
    e.sched_slot[k] = s
    e.sched_tokens[k] = new
    e.sched_ctx[k] = ctx
    e.sched_decode[k] = is_decode
    e.n_sched = k + 1
    e.sums[0] += 1.0
    e.sums[1] += <double>new
    if is_decode:
        e.sums[2] += 1.0
        e.sums[3] += <double>ctx
    else:
        e.sums[4] += <double>new
        e.sums[5] += <double>new * <double>ctx + <double>new * <double>(new + 1) / 2.0
        e.sums[6] += 1.0
        e.sums[7] += <double>ctx


cdef inline void _preempt_last(Engine* e, bint cache) noexcept nogil:
    """Preempt the lowest-priority running request: recompute, to the waiting front."""
    cdef int64_t v = e.running[e.n_running - 1]
    e.n_running -= 1
    _free_all(e, v, cache)
    e.num_computed[v] = 0
    e.num_preempt[v] += 1
    if e.n_waiting > 0:
        memmove(&e.waiting[1], &e.waiting[0], <size_t>e.n_waiting * sizeof(int64_t))
    e.waiting[0] = v
    e.n_waiting += 1
    e.preempted[e.n_preempted] = v
    e.n_preempted += 1


cdef inline int64_t _schedule_impl(Engine* e, bint cache) noexcept nogil:
    """Form one batch; returns the number of scheduled requests.

    Running requests first, in order: each takes its remaining tokens (one for a decoder,
    the rest of its prefill chunked to the budget); if its KV blocks do not fit, the last
    running request is preempted until they do (possibly itself, which ends the pass).
    Then, only if nothing was preempted, waiting requests FCFS while slots, budget and
    blocks allow; a request that does not fit stops the pass (no skipping ahead). With
    the prefix cache, a waiting request with nothing computed starts after its longest
    cached prefix, and taking cached blocks that sit in the free queue takes free blocks.

    ``cache`` (``_cache_active``: lookups, registrations, evictions) is a constant in each
    caller, ``_schedule_plain`` and ``_schedule_cached``, so that the plain loop is
    compiled without anything of the prefix cache.
    """
    cdef int64_t budget = e.token_budget
    cdef int64_t i = 0, s, need, new, req_blocks, j, hit = -1, evictable = 0
    cdef bint self_preempted
    e.n_sched = 0
    e.n_preempted = 0
    for j in range(8):
        e.sums[j] = 0.0

    while i < e.n_running and budget > 0:
        s = e.running[i]
        need = e.num_prompt[s] + e.num_output[s] - e.num_computed[s]
        new = need if need < budget else budget
        req_blocks = _extra_blocks(e, s, new)
        self_preempted = False
        while req_blocks > e.free_blocks:
            if e.running[e.n_running - 1] == s:
                self_preempted = True
            _preempt_last(e, cache)
            if self_preempted:
                break
        if self_preempted:
            break
        if req_blocks > 0:
            _take_blocks(e, s, req_blocks, cache)
        if cache:
            _cache_scheduled(e, s, new)
        _record(e, s, new)
        budget -= new
        i += 1

    if e.n_preempted == 0:
        while e.n_waiting > 0 and budget > 0 and e.n_running < e.max_num_seqs:
            s = e.waiting[0]
            if cache:
                evictable = 0
                hit = _lookup_waiting(e, s, &evictable)
            need = e.num_prompt[s] + e.num_output[s] - e.num_computed[s]
            new = need if need < budget else budget
            req_blocks = _extra_blocks(e, s, new)
            if req_blocks + evictable > e.free_blocks:
                if hit > 0:
                    e.num_computed[s] = 0
                    e.num_blocks[s] = 0
                break
            e.n_waiting -= 1
            if e.n_waiting > 0:
                memmove(&e.waiting[0], &e.waiting[1], <size_t>e.n_waiting * sizeof(int64_t))
            e.running[e.n_running] = s
            e.n_running += 1
            if cache and hit >= 0:
                _admit_cached(e, s, hit)  # its cached blocks out of the queue first
            _take_blocks(e, s, req_blocks, cache)
            if cache:
                _cache_scheduled(e, s, new)
            _record(e, s, new)
            budget -= new
    return e.n_sched


cdef int64_t _schedule_plain(Engine* e) noexcept nogil:
    """``_schedule_impl`` when the prefix cache is off or holds nothing (and in the BEA
    replay, which has none)."""
    return _schedule_impl(e, False)


cdef int64_t _schedule_cached(Engine* e) noexcept nogil:
    """``_schedule_impl`` with the prefix cache active."""
    return _schedule_impl(e, True)


# The BEA replay calls _schedule_plain through this pointer, so that the compiler keeps it
# a function of its own there: inlined into the replay (whose Engine lives on its stack),
# the same loop ran about 20% more instructions (callgrind, 128 residents).
cdef int64_t (*_replay_schedule)(Engine*) noexcept nogil
_replay_schedule = _schedule_plain


cdef int64_t _commit(Engine* e) noexcept nogil:
    """Apply the last batch: advance computed tokens, emit tokens, retire finished requests.

    A request whose known tokens are all computed after the batch samples one output token
    (its first one ends its prefill). A request that reaches max_output frees its slot and
    blocks. Returns the number of events written to ev_slot / ev_flags.
    """
    cdef int64_t k, s, flags, w = 0, r
    e.n_events = 0
    for k in range(e.n_sched):
        s = e.sched_slot[k]
        e.num_computed[s] += e.sched_tokens[k]
        if e.num_computed[s] == e.num_prompt[s] + e.num_output[s]:
            e.num_output[s] += 1
            flags = EV_FIRST_TOKEN if e.num_output[s] == 1 else 0
            if e.num_output[s] >= e.max_output[s]:
                flags |= EV_FINISHED
                _free_all(e, s, e.pc != NULL)
            if flags:
                e.ev_slot[e.n_events] = s
                e.ev_flags[e.n_events] = flags
                e.n_events += 1
    if e.n_events > 0:
        # drop finished requests from running, keeping order
        for r in range(e.n_running):
            s = e.running[r]
            if e.num_output[s] < e.max_output[s]:
                e.running[w] = s
                w += 1
        e.n_running = w
    e.n_sched = 0
    return e.n_events


_NO_HASHES = np.zeros(0, dtype=np.int64)


def checked_block_hashes(block_hashes, int64_t prompt_tokens, int64_t block_size):
    """``block_hashes`` as a C-ordered int64 array (None: empty), or ValueError unless
    they are one-dimensional integers >= 0, at most one per full block of the prompt."""
    if block_hashes is None:
        return _NO_HASHES
    h = np.asarray(block_hashes)
    if h.ndim != 1 or (h.size > 0 and h.dtype.kind not in "iu"):
        raise ValueError("block_hashes must be a one-dimensional sequence of integers")
    if h.size > 0 and (h.min() < 0 or h.max() > np.iinfo(np.int64).max):
        raise ValueError("block hashes must be integers in [0, 2**63)")
    full = prompt_tokens // block_size
    if h.shape[0] > full:
        raise ValueError(f"{h.shape[0]} block hashes for a prompt of {prompt_tokens} tokens, "
                         f"which has {full} full blocks of {block_size}")
    return np.ascontiguousarray(h, dtype=np.int64)


cdef class BatchCore:
    """One engine's scheduler state; slots are reused after a request finishes.

    Parameters are the engine's limits: ``num_kv_blocks`` blocks of ``block_size`` tokens,
    at most ``max_num_seqs`` running requests, ``max_num_batched_tokens`` tokens per batch;
    ``prefix_caching`` turns vLLM's automatic prefix caching on (as vLLM v1's default):
    only requests added with block hashes use it.

    ``kv_events`` (with prefix caching) logs the cache's events as vLLM publishes them:
    (KV_STORED, hash) when a block enters the cache, (KV_REMOVED, hash) when one is
    evicted, in order; ``take_kv_events`` takes them. At most ``kv_events_capacity``
    are kept between takes, the rest counted as dropped.
    """

    cdef Engine e
    cdef readonly int64_t capacity
    cdef object _arrays
    cdef object _free_slots
    cdef int64_t[::1] _num_prompt, _num_output, _max_output, _num_computed, _num_blocks
    cdef int64_t[::1] _num_preempt, _running, _waiting
    cdef int64_t[::1] _sched_slot, _sched_tokens, _sched_ctx, _sched_decode, _preempted
    cdef int64_t[::1] _ev_slot, _ev_flags
    cdef int64_t[::1] _num_hashes, _num_cached, _cached_tokens
    cdef PrefixCache pc
    cdef int64_t* _pc_buf       # the entries and the hash table, one allocation
    cdef int64_t** _hbuf        # per slot: hashes then entry ids (NULL: none)

    def __init__(self, int64_t num_kv_blocks, int64_t block_size, int64_t max_num_seqs,
                 int64_t max_num_batched_tokens, int64_t capacity=256,
                 bint prefix_caching=True, bint kv_events=False,
                 int64_t kv_events_capacity=65536):
        if kv_events_capacity < 0:
            raise ValueError("kv_events_capacity must be >= 0")
        if num_kv_blocks < 1 or block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("BatchCore limits must all be >= 1")
        if self._pc_buf != NULL or self.capacity != 0:
            raise RuntimeError("BatchCore is initialised once")
        self.e.total_blocks = num_kv_blocks
        self.e.free_blocks = num_kv_blocks
        self.e.block_size = block_size
        self.e.max_num_seqs = max_num_seqs
        self.e.token_budget = max_num_batched_tokens
        self.e.n_running = 0
        self.e.n_waiting = 0
        self.e.n_sched = 0
        self.e.n_preempted = 0
        self.e.n_events = 0
        self.capacity = 0
        self._free_slots = []
        self.pc.kv_log = NULL
        if prefix_caching:
            self._init_prefix_cache(num_kv_blocks)
            if kv_events:
                self._init_kv_log(kv_events_capacity)
        self._grow(max(capacity, 1))

    cdef void _init_prefix_cache(self, int64_t num_blocks):
        """Entries for as many blocks as the engine has, and a hash table of at least
        twice as many slots (a power of two): it never holds more keys than entries."""
        cdef int64_t size = 16, i
        cdef PrefixCache* pc = &self.pc
        while size < 2 * num_blocks:
            size *= 2
        self._pc_buf = <int64_t*>malloc(<size_t>(6 * num_blocks + 2 * size) * sizeof(int64_t))
        if self._pc_buf == NULL:
            raise MemoryError("prefix cache allocation failed")
        pc.ent_hash = self._pc_buf
        pc.ent_ref = self._pc_buf + num_blocks
        pc.ent_prev = self._pc_buf + 2 * num_blocks
        pc.ent_next = self._pc_buf + 3 * num_blocks
        pc.ent_gap = self._pc_buf + 4 * num_blocks
        pc.ent_dup = self._pc_buf + 5 * num_blocks
        pc.tab_key = self._pc_buf + 6 * num_blocks
        pc.tab_val = pc.tab_key + size
        pc.tab_mask = size - 1
        for i in range(num_blocks):
            pc.ent_next[i] = i + 1 if i + 1 < num_blocks else -1
        for i in range(size):
            pc.tab_key[i] = -1
        pc.unused = 0
        pc.q_head = -1
        pc.q_tail = -1
        pc.sum_gaps = 0
        pc.num_hashed = 0
        pc.num_entries = 0
        pc.num_evictable = 0
        pc.queries = 0
        pc.hits = 0
        self.e.pc = pc

    cdef void _init_kv_log(self, int64_t capacity) except *:
        """The KV-event log: room for ``capacity`` kinds, then as many hashes."""
        self.pc.kv_log = <int64_t*>malloc(<size_t>(2 * capacity + 1) * sizeof(int64_t))
        if self.pc.kv_log == NULL:
            raise MemoryError("KV-event log allocation failed")
        self.pc.kv_capacity = capacity
        self.pc.kv_len = 0
        self.pc.kv_dropped = 0

    def __dealloc__(self):
        cdef int64_t i
        if self._hbuf != NULL:
            for i in range(self.capacity):
                free(self._hbuf[i])
            free(self._hbuf)
        free(self._pc_buf)
        free(self.pc.kv_log)

    cdef void _bind(self):
        self.e.num_prompt = &self._num_prompt[0]
        self.e.num_output = &self._num_output[0]
        self.e.max_output = &self._max_output[0]
        self.e.num_computed = &self._num_computed[0]
        self.e.num_blocks = &self._num_blocks[0]
        self.e.num_preempt = &self._num_preempt[0]
        self.e.running = &self._running[0]
        self.e.waiting = &self._waiting[0]
        self.e.sched_slot = &self._sched_slot[0]
        self.e.sched_tokens = &self._sched_tokens[0]
        self.e.sched_ctx = &self._sched_ctx[0]
        self.e.sched_decode = &self._sched_decode[0]
        self.e.preempted = &self._preempted[0]
        self.e.ev_slot = &self._ev_slot[0]
        self.e.ev_flags = &self._ev_flags[0]
        self.pc.num_hashes = &self._num_hashes[0]
        self.pc.num_cached = &self._num_cached[0]
        self.pc.cached_tokens = &self._cached_tokens[0]
        self.pc.hashes = self._hbuf

    def _grow(self, int64_t new_capacity):
        """Resize every per-slot array to new_capacity, keeping contents (outside the loop)."""
        cdef int64_t** hbuf
        cdef int64_t i
        old = self.capacity
        names = ("num_prompt", "num_output", "max_output", "num_computed", "num_blocks",
                 "num_preempt", "running", "waiting", "sched_slot", "sched_tokens",
                 "sched_ctx", "sched_decode", "preempted", "ev_slot", "ev_flags",
                 "num_hashes", "num_cached", "cached_tokens")
        fresh = {}
        for name in names:
            a = np.zeros(new_capacity, dtype=np.int64)
            if old > 0:
                a[:old] = self._arrays[name]
            fresh[name] = a
        self._num_prompt = fresh["num_prompt"]
        self._num_output = fresh["num_output"]
        self._max_output = fresh["max_output"]
        self._num_computed = fresh["num_computed"]
        self._num_blocks = fresh["num_blocks"]
        self._num_preempt = fresh["num_preempt"]
        self._running = fresh["running"]
        self._waiting = fresh["waiting"]
        self._sched_slot = fresh["sched_slot"]
        self._sched_tokens = fresh["sched_tokens"]
        self._sched_ctx = fresh["sched_ctx"]
        self._sched_decode = fresh["sched_decode"]
        self._preempted = fresh["preempted"]
        self._ev_slot = fresh["ev_slot"]
        self._ev_flags = fresh["ev_flags"]
        self._num_hashes = fresh["num_hashes"]
        self._num_cached = fresh["num_cached"]
        self._cached_tokens = fresh["cached_tokens"]
        hbuf = <int64_t**>realloc(self._hbuf, <size_t>new_capacity * sizeof(int64_t*))
        if hbuf == NULL:
            raise MemoryError("slot table allocation failed")
        self._hbuf = hbuf
        for i in range(old, new_capacity):
            hbuf[i] = NULL
        self._arrays = fresh
        # hand out low slots first so tables stay dense
        self._free_slots.extend(range(new_capacity - 1, old - 1, -1))
        self.capacity = new_capacity
        self._bind()

    def add_request(self, int64_t prompt_tokens, int64_t max_output_tokens,
                    int64_t computed_tokens=0, block_hashes=None):
        """Queue a new request at the back of the waiting queue; returns its slot.

        ``computed_tokens`` (< prompt_tokens) of its prompt already have their KV computed
        elsewhere (a prefill instance's, moved here): only the rest is scheduled, and the
        blocks for all of them are allocated when it is first scheduled.

        ``block_hashes`` (integers >= 0, at most one per full block of the prompt, from
        its first block on) name the prompt's blocks for the prefix cache: a block's hash
        stands for its whole prefix (a hash chain), so equal hashes at block i mean equal
        first i + 1 blocks. Ignored when prefix caching is off.

        Raises ValueError if the request could never fit in the KV cache (it would block
        the FCFS queue forever), or for hashes that are not as above.
        """
        if prompt_tokens < 1 or max_output_tokens < 1:
            raise ValueError("prompt_tokens and max_output_tokens must be >= 1")
        if computed_tokens < 0 or computed_tokens >= prompt_tokens:
            raise ValueError("computed_tokens must be >= 0 and < prompt_tokens")
        if _blocks_for(prompt_tokens + max_output_tokens, self.e.block_size) > self.e.total_blocks:
            raise ValueError(
                f"request of {prompt_tokens}+{max_output_tokens} tokens exceeds the KV capacity "
                f"of {self.e.total_blocks * self.e.block_size} tokens")
        hashes = checked_block_hashes(block_hashes, prompt_tokens, self.e.block_size)
        if not self._free_slots:
            self._grow(self.capacity * 2)
        cdef int64_t s = self._free_slots.pop()
        self.e.num_prompt[s] = prompt_tokens
        self.e.num_output[s] = 0
        self.e.max_output[s] = max_output_tokens
        self.e.num_computed[s] = computed_tokens
        self.e.num_blocks[s] = 0
        self.e.num_preempt[s] = 0
        self.pc.num_hashes[s] = 0
        self.pc.num_cached[s] = 0
        self.pc.cached_tokens[s] = 0
        if self.e.pc != NULL and len(hashes) > 0:
            self._set_hashes(s, hashes)
        self.e.waiting[self.e.n_waiting] = s
        self.e.n_waiting += 1
        return s

    cdef void _set_hashes(self, int64_t s, const int64_t[::1] hashes) except *:
        """Slot s's hashes, copied, with room for as many entry ids after them."""
        cdef int64_t n = hashes.shape[0]
        cdef int64_t* buf = <int64_t*>malloc(<size_t>(2 * n) * sizeof(int64_t))
        if buf == NULL:
            raise MemoryError("block hash allocation failed")
        memcpy(buf, &hashes[0], <size_t>n * sizeof(int64_t))
        self._hbuf[s] = buf
        self.pc.num_hashes[s] = n
        self.pc.num_hashed += 1

    cdef void _drop_hashes(self, int64_t s):
        if self._hbuf[s] != NULL:
            free(self._hbuf[s])
            self._hbuf[s] = NULL
            self.pc.num_hashed -= 1
        self.pc.num_hashes[s] = 0

    def release_slot(self, int64_t slot):
        """Return a finished request's slot for reuse (after its events were read)."""
        if self.e.num_output[slot] < self.e.max_output[slot]:
            raise ValueError(f"slot {slot} has not finished")
        self.e.max_output[slot] = 0
        self.e.num_output[slot] = 0
        self._drop_hashes(slot)
        self._free_slots.append(slot)

    def abort(self, int64_t slot):
        """Remove an unfinished request (running or waiting, keeping the others' order),
        free its KV blocks and its slot, as when its client goes away.

        Only between batches: a batch scheduled and not yet committed still refers to its
        slots, so abort() then raises ValueError (commit() first). Scheduling rules are
        untouched: the next schedule() sees the queues without the request.
        """
        cdef int64_t r, n
        if slot < 0 or slot >= self.capacity:
            raise IndexError(f"slot {slot} out of range")
        if self.e.n_sched > 0:
            raise ValueError("cannot abort while a batch is scheduled; commit() first")
        if self.e.num_output[slot] >= self.e.max_output[slot]:
            raise ValueError(f"slot {slot} holds no unfinished request")
        for r in range(self.e.n_running):
            if self.e.running[r] == slot:
                n = self.e.n_running - r - 1
                if n > 0:
                    memmove(&self.e.running[r], &self.e.running[r + 1], <size_t>n * sizeof(int64_t))
                self.e.n_running -= 1
                break
        else:
            for r in range(self.e.n_waiting):
                if self.e.waiting[r] == slot:
                    n = self.e.n_waiting - r - 1
                    if n > 0:
                        memmove(&self.e.waiting[r], &self.e.waiting[r + 1],
                                <size_t>n * sizeof(int64_t))
                    self.e.n_waiting -= 1
                    break
        _free_all(&self.e, slot, self.e.pc != NULL)
        self.e.num_computed[slot] = 0
        self.e.max_output[slot] = 0
        self.e.num_output[slot] = 0
        self._drop_hashes(slot)
        self._free_slots.append(slot)

    def schedule(self):
        """Form one batch. Returns (num_scheduled, sums) where sums is a tuple of
        (num_seqs, num_tokens, num_decode_tokens, sum_decode_context, num_prefill_tokens,
        sum_prefill_attention, num_prefill_seqs, sum_prefill_context); context means the
        tokens already in the KV cache before this batch, and the prefill attention term
        of a chunk is chunk*context + chunk*(chunk+1)/2."""
        cdef int64_t n
        with nogil:
            if _cache_active(&self.e):
                n = _schedule_cached(&self.e)
            else:
                n = _schedule_plain(&self.e)
        s = self.e.sums
        return n, (s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7])

    def commit(self):
        """Apply the last batch. Returns the number of events; read them with events()."""
        cdef int64_t n
        with nogil:
            n = _commit(&self.e)
        return n

    def events(self):
        """(slots, flags) of the last commit's events as new int64 arrays; flag bit 1 is
        the first token, bit 2 the finish."""
        n = self.e.n_events
        return (np.asarray(self._ev_slot)[:n].copy(), np.asarray(self._ev_flags)[:n].copy())

    def event_list(self):
        """The last commit's events as a list of (slot, flags) pairs."""
        cdef int64_t k
        return [(self.e.ev_slot[k], self.e.ev_flags[k]) for k in range(self.e.n_events)]

    def batch(self):
        """The last scheduled batch as arrays (slots, tokens, context, is_decode), before
        commit() is called."""
        n = self.e.n_sched
        return (np.asarray(self._sched_slot)[:n].copy(), np.asarray(self._sched_tokens)[:n].copy(),
                np.asarray(self._sched_ctx)[:n].copy(), np.asarray(self._sched_decode)[:n].copy())

    def preempted(self):
        """Slots preempted while forming the last batch, in order."""
        return np.asarray(self._preempted)[:self.e.n_preempted].copy()

    def running(self):
        return np.asarray(self._running)[:self.e.n_running].copy()

    def waiting(self):
        return np.asarray(self._waiting)[:self.e.n_waiting].copy()

    def request(self, int64_t slot):
        """(prompt, output, max_output, computed, blocks, preemptions) of a slot."""
        if slot < 0 or slot >= self.capacity:
            raise IndexError(f"slot {slot} out of range")
        return (self.e.num_prompt[slot], self.e.num_output[slot], self.e.max_output[slot],
                self.e.num_computed[slot], self.e.num_blocks[slot], self.e.num_preempt[slot])

    def prefix_state(self, int64_t slot):
        """(block hashes, leading blocks held as cache entries, prompt tokens found cached
        at its first admission) of a slot."""
        if slot < 0 or slot >= self.capacity:
            raise IndexError(f"slot {slot} out of range")
        return (self.pc.num_hashes[slot], self.pc.num_cached[slot],
                self.pc.cached_tokens[slot])

    def free_queue(self):
        """The free blocks in eviction order, compressed: ([(unhashed blocks before it,
        hash), ...] for each cached block that no request holds, unhashed blocks after
        the last). Without prefix caching, ([], free blocks)."""
        cdef int64_t x
        if self.e.pc == NULL:
            return [], self.e.free_blocks
        out = []
        x = self.pc.q_head
        while x >= 0:
            out.append((self.pc.ent_gap[x], self.pc.ent_hash[x]))
            x = self.pc.ent_next[x]
        return out, _tail(&self.pc, self.e.free_blocks)

    def cache_contents(self):
        """Sorted (hash, blocks cached under it) of every hash the cache finds."""
        cdef int64_t i, x, n
        out = []
        if self.e.pc == NULL:
            return out
        for i in range(self.pc.tab_mask + 1):
            if self.pc.tab_key[i] != -1:
                n = 0
                x = self.pc.tab_val[i]
                while x >= 0:
                    n += 1
                    x = self.pc.ent_dup[x]
                out.append((self.pc.tab_key[i], n))
        out.sort()
        return out

    def take_kv_events(self):
        """The cache's events since the last take, and empties the log: (kinds, hashes,
        dropped), kinds KV_STORED or KV_REMOVED as new int64 arrays, ``dropped`` the
        events past the log's capacity that were not kept (a consumer then resyncs from
        ``cache_contents``). Empty, and 0, without KV events."""
        cdef int64_t n = self.pc.kv_len
        kinds = np.empty(n, dtype=np.int64)
        hashes = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] k = kinds, h = hashes
        if n > 0:
            memcpy(&k[0], self.pc.kv_log, <size_t>n * sizeof(int64_t))
            memcpy(&h[0], self.pc.kv_log + self.pc.kv_capacity, <size_t>n * sizeof(int64_t))
        dropped = self.pc.kv_dropped
        self.pc.kv_len = 0
        self.pc.kv_dropped = 0
        return kinds, hashes, dropped

    @property
    def kv_events(self):
        """Does the core log its prefix cache's events?"""
        return self.pc.kv_log != NULL

    @property
    def prefix_caching(self):
        return self.e.pc != NULL

    @property
    def prefix_cache_queries(self):
        """Tokens of the requests admitted after a cache lookup (prompt and output so far,
        as vLLM's ``prefix_cache_queries``)."""
        return self.pc.queries

    @property
    def prefix_cache_hits(self):
        """Of those, the tokens found in the cache (vLLM's ``prefix_cache_hits``)."""
        return self.pc.hits

    @property
    def num_cached_blocks(self):
        """Blocks that carry a hash, held by requests or free and evictable."""
        return self.pc.num_entries

    @property
    def num_evictable_blocks(self):
        """Free blocks that still carry a hash (counted in num_free_blocks)."""
        return self.pc.num_evictable

    @property
    def num_running(self):
        return self.e.n_running

    @property
    def num_waiting(self):
        return self.e.n_waiting

    @property
    def num_free_blocks(self):
        return self.e.free_blocks

    @property
    def num_kv_blocks(self):
        return self.e.total_blocks

    @property
    def block_size(self):
        return self.e.block_size

    @property
    def max_num_seqs(self):
        return self.e.max_num_seqs

    @property
    def max_num_batched_tokens(self):
        return self.e.token_budget

    def snapshot(self, const int64_t[::1] predicted_by_slot, const int64_t[::1] id_by_slot):
        """The scheduler state as snapshot arrays: (table, ids, num_running,
        num_free_blocks, inflight). ``table`` rows are running then waiting requests with
        columns prompt, output, predicted (from predicted_by_slot), computed, blocks;
        ``ids`` maps rows through id_by_slot; ``inflight`` rows are (table row, tokens)
        of the batch scheduled and not yet committed. A waiting request with nothing
        computed counts as computed the prefix it would find cached if admitted now
        (looked up without touching the cache; it holds no block yet)."""
        cdef int64_t n = self.e.n_running + self.e.n_waiting
        cdef int64_t m = self.e.n_sched
        table_np = np.empty((n, 5), dtype=np.int64)
        slots_np = np.empty(n, dtype=np.int64)
        inflight_np = np.empty((m, 2), dtype=np.int64)
        cdef int64_t[:, ::1] table = table_np
        cdef int64_t[::1] slots = slots_np
        cdef int64_t[:, ::1] inflight = inflight_np
        cdef int64_t r, s, k, j, evictable = 0
        cdef bint cache = _cache_active(&self.e)
        if predicted_by_slot.shape[0] < self.capacity or id_by_slot.shape[0] < self.capacity:
            raise ValueError("predicted_by_slot and id_by_slot must cover the slot table")
        for r in range(n):
            s = self.e.running[r] if r < self.e.n_running else self.e.waiting[r - self.e.n_running]
            slots[r] = id_by_slot[s]
            table[r, 0] = self.e.num_prompt[s]
            table[r, 1] = self.e.num_output[s]
            table[r, 2] = predicted_by_slot[s]
            table[r, 3] = self.e.num_computed[s]
            table[r, 4] = self.e.num_blocks[s]
            if (cache and r >= self.e.n_running and self.e.num_computed[s] == 0
                    and self.pc.num_hashes[s] > 0):
                table[r, 3] = self.e.block_size * _lookup(
                    &self.pc, s, (self.e.num_prompt[s] + self.e.num_output[s] - 1)
                    // self.e.block_size, &evictable)
        for k in range(m):
            s = self.e.sched_slot[k]
            inflight[k, 1] = self.e.sched_tokens[k]
            inflight[k, 0] = -1
            for j in range(self.e.n_running):
                if self.e.running[j] == s:
                    inflight[k, 0] = j
                    break
        return table_np, slots_np, self.e.n_running, self.e.free_blocks, inflight_np


# -- BEA replay --------------------------------------------------------------------------

cdef inline double _beta_time(const double* beta, double* sums) noexcept nogil:
    return beta[0] + beta[1] * sums[1] + beta[2] * sums[3] + beta[3] * sums[5]


cdef int64_t* _replay_setup(
    Engine* e, const int64_t* table, int64_t n_res, int64_t num_running,
    int64_t free_blocks, const double[:, ::1] extras, int64_t total_blocks,
    int64_t block_size, int64_t max_num_seqs, int64_t token_budget) noexcept nogil:
    """Scratch arrays for a replay of one instance with one slot for a new request (the
    last), filled from the snapshot's table and the router's later dispatches; NULL when
    the allocation fails. The caller frees the returned buffer. ``table`` is the
    snapshot's (n_res, SNAP_COLUMNS) rows, C order."""
    cdef int64_t n_extra = extras.shape[0]
    cdef int64_t n = n_res + n_extra + 1
    cdef int64_t k, r
    cdef const int64_t* row
    cdef int64_t* buf = <int64_t*>malloc(<size_t>(n * 15 + 8) * sizeof(int64_t))
    if buf == NULL:
        return NULL
    e.num_prompt = buf
    e.num_output = buf + n
    e.max_output = buf + 2 * n
    e.num_computed = buf + 3 * n
    e.num_blocks = buf + 4 * n
    e.num_preempt = buf + 5 * n
    e.running = buf + 6 * n
    e.waiting = buf + 7 * n
    e.sched_slot = buf + 8 * n
    e.sched_tokens = buf + 9 * n
    e.sched_ctx = buf + 10 * n
    e.sched_decode = buf + 11 * n
    e.preempted = buf + 12 * n
    e.ev_slot = buf + 13 * n
    e.ev_flags = buf + 14 * n
    for r in range(n_res):
        row = table + r * SNAP_COLUMNS
        e.num_prompt[r] = row[0]
        e.num_output[r] = row[1]
        # a request past its prediction has at least one token left (it has not finished)
        e.max_output[r] = row[2] if row[2] > row[1] else row[1] + 1
        e.num_computed[r] = row[3]
        e.num_blocks[r] = row[4]
        e.num_preempt[r] = 0
    for k in range(n_extra):
        r = n_res + k
        e.num_prompt[r] = <int64_t>extras[k, 0]
        e.num_output[r] = 0
        e.max_output[r] = <int64_t>extras[k, 1] if extras[k, 1] >= 1.0 else 1
        # a fourth column: its prompt tokens the router expects cached there
        e.num_computed[r] = _cached_of(<int64_t>extras[k, 3], e.num_prompt[r]) if (
            extras.shape[1] > 3) else 0
        e.num_blocks[r] = 0
        e.num_preempt[r] = 0
    e.n_running = num_running
    for r in range(num_running):
        e.running[r] = r
    e.n_waiting = n_res - num_running
    for r in range(e.n_waiting):
        e.waiting[r] = num_running + r
    e.free_blocks = free_blocks
    e.total_blocks = total_blocks
    e.block_size = block_size
    e.max_num_seqs = max_num_seqs
    e.token_budget = token_budget
    e.n_preempted = 0
    e.n_events = 0
    e.pc = NULL
    return buf


cdef double _replay_to_now(
    Engine* e, int64_t n_res, const int64_t* inflight, int64_t n_inflight,
    double inflight_start_s, double snap_time_s, const double[:, ::1] extras,
    const double* beta, double now_s, int64_t max_batches) noexcept nogil:
    """Stages 1 and 2 of a replay (the engine as it stands at now, without the new
    request); returns the replayed clock, at least now.

    The in-flight batch completes first (at its start plus its estimated time, and not
    before the snapshot); while the replayed clock is before now (a stale snapshot),
    batches run without the new request, and the router's own dispatches since the
    snapshot (extras: prompt, predicted output, dispatch time; in dispatch order) join
    the queue at their dispatch times."""
    cdef int64_t n_extra = extras.shape[0]
    cdef int64_t i, k, nb = 0, released = 0
    cdef double t = snap_time_s
    e.n_sched = 0
    for i in range(8):
        e.sums[i] = 0.0
    if n_inflight > 0:
        for k in range(n_inflight):
            _record(e, inflight[2 * k], inflight[2 * k + 1])
        t = inflight_start_s + _beta_time(beta, e.sums)
        # the batch was still running at snapshot time, whatever its estimate says
        if t < snap_time_s:
            t = snap_time_s
        _commit(e)
    while nb < max_batches:
        while released < n_extra and extras[released, 2] <= t:
            e.waiting[e.n_waiting] = n_res + released
            e.n_waiting += 1
            released += 1
        if t >= now_s:
            break
        if _replay_schedule(e) == 0:
            if released < n_extra and extras[released, 2] < now_s:
                t = extras[released, 2]  # idle until the next dispatch
                continue
            break
        t += _beta_time(beta, e.sums)
        _commit(e)
        nb += 1
    while released < n_extra:  # dispatched before now in any case
        e.waiting[e.n_waiting] = n_res + released
        e.n_waiting += 1
        released += 1
    if t < now_s:
        t = now_s
    return t


cdef inline int64_t _cached_of(int64_t cached, int64_t prompt) noexcept nogil:
    """Prompt tokens taken as cached: within [0, prompt - 1] (the last one is computed)."""
    if cached >= prompt:
        cached = prompt - 1
    return cached if cached > 0 else 0


cdef void _replay_new(Engine* e, int64_t new_slot, int64_t new_prompt, int64_t new_decode,
                      int64_t new_cached, double t, const double* beta, double now_s,
                      int64_t max_batches, double* out) noexcept nogil:
    """Stage 3: the new request joins the back of the queue (slot ``new_slot``), its
    first ``new_cached`` prompt tokens cached (computed: its prefill is the rest; it
    still takes blocks for all of them, as if the cached blocks sat in the free queue);
    batches run until its first token. out = (ttft from now, wait before its first
    chunk, batches replayed), inf for both times if the first token is not reached."""
    cdef int64_t k, nb = 0
    cdef double dur, wait = -1.0
    e.num_prompt[new_slot] = new_prompt
    e.num_output[new_slot] = 0
    e.max_output[new_slot] = new_decode if new_decode > 0 else 1
    e.num_computed[new_slot] = _cached_of(new_cached, new_prompt)
    e.num_blocks[new_slot] = 0
    e.num_preempt[new_slot] = 0
    e.waiting[e.n_waiting] = new_slot
    e.n_waiting += 1
    out[0] = INFINITY
    out[1] = INFINITY
    while nb < max_batches:
        if _replay_schedule(e) == 0:
            break
        nb += 1
        dur = _beta_time(beta, e.sums)
        if wait < 0.0:
            for k in range(e.n_sched):
                if e.sched_slot[k] == new_slot:
                    wait = t - now_s
                    break
        t += dur
        _commit(e)
        if e.num_output[new_slot] > 0:
            out[0] = t - now_s
            out[1] = wait
            break
    out[2] = <double>nb


cdef int _replay_one(
    const int64_t* table, int64_t n_res, int64_t num_running, int64_t free_blocks,
    const int64_t* inflight, int64_t n_inflight, double inflight_start_s,
    double snap_time_s,
    const double[:, ::1] extras, int64_t total_blocks, int64_t block_size,
    int64_t max_num_seqs, int64_t token_budget, const double* beta,
    const int64_t* new_prompt, const int64_t* new_decode, const int64_t* new_cached,
    int64_t n_new, int64_t decode_stride, double now_s, int64_t max_batches, double* out,
    int64_t out_stride) noexcept nogil:
    """Replay one instance until each new request's first token, each alone behind the
    queue: stages 1 and 2 (``_replay_to_now``) once, then stage 3 (``_replay_new``) per
    new request i from a copy of that state; out[i * out_stride] = (ttft, wait, n).
    ``new_cached[i * decode_stride]``: its cached prompt tokens (NULL: none)."""
    cdef int64_t n = n_res + extras.shape[0] + 1
    cdef size_t size = <size_t>(n * 15 + 8) * sizeof(int64_t)
    cdef int64_t i
    cdef double t
    cdef Engine e, saved
    cdef int64_t* copy = NULL
    cdef int64_t* buf = _replay_setup(&e, table, n_res, num_running, free_blocks, extras,
                                      total_blocks, block_size, max_num_seqs, token_budget)
    if buf == NULL:
        return -1
    t = _replay_to_now(&e, n_res, inflight, n_inflight, inflight_start_s, snap_time_s,
                       extras, beta, now_s, max_batches)
    if n_new > 1:
        copy = <int64_t*>malloc(size)
        if copy == NULL:
            free(buf)
            return -1
        memcpy(copy, buf, size)
        saved = e
    for i in range(n_new):
        if i > 0:
            memcpy(buf, copy, size)
            e = saved
        _replay_new(&e, n - 1, new_prompt[i], new_decode[i * decode_stride],
                    0 if new_cached == NULL else new_cached[i * decode_stride], t, beta,
                    now_s, max_batches, out + i * out_stride)
    free(copy)
    free(buf)
    return 0


_EMPTY_EXTRAS = np.zeros((0, 3), dtype=np.float64)


cdef inline cnp.ndarray _int_rows(object a, Py_ssize_t columns, Py_ssize_t g, str name):
    """``a`` as a C-ordered, aligned, native-order int64 (n, columns) array (any type
    number equivalent to int64), or ValueError naming it."""
    if (not isinstance(a, cnp.ndarray)
            or not cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(<cnp.ndarray>a), cnp.NPY_INT64)
            or not cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>a)
            or not cnp.PyArray_ISALIGNED(<cnp.ndarray>a)
            or cnp.PyArray_NDIM(<cnp.ndarray>a) != 2
            or cnp.PyArray_DIM(<cnp.ndarray>a, 1) != columns
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a)):
        raise ValueError(f"snapshot {g}: {name} must be a C-ordered int64 array of "
                         f"{columns} columns")
    return <cnp.ndarray>a


def replay_ttft(list snapshots, const int64_t[:, ::1] limits, const double[:, ::1] beta,
                int64_t new_prompt, const int64_t[::1] new_decode, double now_s,
                list extras=None, int64_t max_batches=200000, new_cached=None):
    """BEA replay for every instance of one decision, in one call.

    ``snapshots[g]`` is an EngineSnapshot; ``limits[g]`` = (num_kv_blocks, block_size,
    max_num_seqs, max_num_batched_tokens); ``beta[g]`` the 4 batch-time coefficients;
    ``new_decode[g]`` the new request's predicted output tokens on instance g;
    ``extras[g]`` (optional) a float64 (k, 3) array of (prompt, predicted output,
    dispatch time) of requests the router dispatched to g after the snapshot, in
    dispatch order, with a fourth column (optional) of their prompt tokens expected
    cached there; ``new_cached[g]`` (optional, int64) the new request's prompt tokens
    cached on instance g (its prefill computes the rest). Returns float64 (G, 3):
    TTFT seconds from now, waiting seconds before its first prefill chunk, batches
    replayed (inf TTFT if the first token is not reached within max_batches)."""
    cdef Py_ssize_t G = len(snapshots)
    if new_decode.shape[0] != G:
        raise ValueError("limits, beta and new_decode need one row per snapshot")
    prompts = np.array([new_prompt], dtype=np.int64)
    cached = None if new_cached is None else np.asarray(new_cached).reshape(1, G)
    out = replay_ttft_many(snapshots, limits, beta, prompts,
                           np.asarray(new_decode).reshape(1, G), now_s, extras, max_batches,
                           new_cached=cached)
    return out[0]


cdef void _check_many(Py_ssize_t G, Py_ssize_t N, const int64_t[:, ::1] limits,
                      const double[:, ::1] beta, const int64_t[:, ::1] new_decode,
                      list extras, double[:, ::1] loads,
                      const int64_t[:, ::1] new_cached) except *:
    """``replay_ttft_many``'s arguments' shapes, or ValueError."""
    if limits.shape[0] != G or beta.shape[0] != G or new_decode.shape[1] != G:
        raise ValueError("limits, beta and new_decode need one row per snapshot")
    if new_decode.shape[0] != N:
        raise ValueError("new_decode needs one row per new prompt")
    if limits.shape[1] != 4 or beta.shape[1] != 4:
        raise ValueError("limits and beta need 4 columns")
    if extras is not None and len(extras) != G:
        raise ValueError("extras needs one entry per snapshot")
    if loads is not None and (loads.shape[0] != G or loads.shape[1] != 2):
        raise ValueError("loads needs shape (G, 2)")
    if new_cached is not None and (new_cached.shape[0] != N or new_cached.shape[1] != G):
        raise ValueError("new_cached needs shape (N, G), as new_decode")


cdef inline void _count_load(const int64_t* rows, int64_t n_rows, int64_t max_num_seqs,
                             double* load) noexcept nogil:
    """An instance's decode load as ``bea.decode_step_times_s`` counts it from its
    snapshot table: (residents counted, the sum of their contexts), the first
    ``max_num_seqs - 1`` rows, written to ``load[0]``, ``load[1]``."""
    cdef Py_ssize_t i
    cdef Py_ssize_t n_counted = n_rows
    cdef int64_t context = 0
    if n_counted > max_num_seqs - 1:
        n_counted = max_num_seqs - 1
    if n_counted < 0:
        n_counted = 0
    for i in range(n_counted):
        context += rows[i * SNAP_COLUMNS] + rows[i * SNAP_COLUMNS + 1]
    load[0] = <double>n_counted
    load[1] = <double>context


def replay_ttft_many(list snapshots, const int64_t[:, ::1] limits, const double[:, ::1] beta,
                     const int64_t[::1] new_prompts, const int64_t[:, ::1] new_decode,
                     double now_s, list extras=None, int64_t max_batches=200000,
                     double[:, ::1] loads=None, const int64_t[:, ::1] new_cached=None):
    """``replay_ttft`` for N new requests at once, each alone behind each instance's
    queue (as if it were the only one to join): each instance is replayed up to now once
    and then once per new request from a copy of that state. ``new_prompts`` is (N,),
    ``new_decode`` (N, G). Returns float64 (N, G, 3). With ``loads`` (G, 2), also writes
    each instance's decode load as ``bea.decode_step_times_s`` counts it from the same
    snapshot table: (residents counted, the sum of their contexts), the first
    ``max_num_seqs - 1`` rows (what ``_score.Scorer`` reads; N >= 1). ``new_cached``
    (N, G), optional: each new request's prompt tokens cached on each instance."""
    cdef Py_ssize_t G = len(snapshots)
    cdef Py_ssize_t N = new_prompts.shape[0]
    _check_many(G, N, limits, beta, new_decode, extras, loads, new_cached)
    out_np = np.empty((N, G, 3), dtype=np.float64)
    if N == 0:
        return out_np
    cdef double[:, :, ::1] out = out_np
    cdef cnp.ndarray table, inflight
    cdef const int64_t* rows
    cdef const int64_t* flights
    cdef int64_t n_rows
    cdef const double[:, ::1] extra
    cdef const double[:, ::1] no_extras = _EMPTY_EXTRAS   # acquired once, not per instance
    cdef Py_ssize_t g, i
    cdef int rc
    cdef int64_t n_running, n_free
    cdef double start_s, snap_s
    for g in range(G):
        snap = snapshots[g]
        # the snapshot's arrays read through their data pointers, checked, rather than
        # as typed memoryviews: acquiring two per instance was most of an idle replay
        table = _int_rows(snap.table, SNAP_COLUMNS, g, "table")
        inflight = _int_rows(snap.inflight, 2, g, "inflight")
        rows = <const int64_t*>cnp.PyArray_DATA(table)
        n_rows = cnp.PyArray_DIM(table, 0)
        if loads is not None:
            _count_load(rows, n_rows, limits[g, 2], &loads[g, 0])
        n_running = snap.num_running
        n_free = snap.num_free_blocks
        start_s = snap.inflight_start_s
        snap_s = snap.time_s
        ex = None if extras is None else extras[g]
        if ex is None:
            extra = no_extras
        else:
            extra = ex
        if extra.shape[1] != 3 and extra.shape[1] != 4:
            raise ValueError(f"extras[{g}] needs 3 columns (prompt, decode, dispatch time) "
                             "or 4 (and cached prompt tokens)")
        if n_free > limits[g, 0] or n_running > n_rows:
            raise ValueError(f"snapshot {g} is inconsistent with the instance limits")
        flights = <const int64_t*>cnp.PyArray_DATA(inflight)
        for i in range(cnp.PyArray_DIM(inflight, 0)):
            if flights[2 * i] < 0 or flights[2 * i] >= n_rows:
                raise ValueError(f"snapshot {g}: its in-flight batch names row "
                                 f"{flights[2 * i]} of a table of {n_rows}")
        # with the GIL held: an instance's replay takes microseconds, and letting the
        # GIL go per instance let another thread (the server's price tick) take it for
        # a switch interval each time
        rc = _replay_one(rows, n_rows, n_running, n_free, flights,
                         cnp.PyArray_DIM(inflight, 0), start_s, snap_s, extra, limits[g, 0],
                         limits[g, 1], limits[g, 2], limits[g, 3], &beta[g, 0],
                         &new_prompts[0], &new_decode[0, g],
                         NULL if new_cached is None else &new_cached[0, g], N, G, now_s,
                         max_batches, &out[0, g, 0], 3 * G)
        if rc != 0:
            raise MemoryError("replay scratch allocation failed")
    return out_np
