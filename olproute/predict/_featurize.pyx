# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Prompt featuriser kernel: tokens, signed crc32 hashing, token counts, and the
indicator and length-constraint rules over the instruction window, in one pass over the
UTF-8 bytes of the lower-cased prompt.

Kernels only, no policy: which words are indicators, numbers and units, the window and
look-ahead lengths, and the classes of ASCII characters come from the caller
(``olproute.predict.features``). Its plain-Python functions (``tokenize``,
``prompt_stats``, ``Featurizer.hashed``) are the readable statement of the rules; tests
assert that both give bitwise-identical features.

Tokens are those of ``re.findall(r"\\w+|[^\\w\\s]", lowered)`` for all of Unicode, not
only ASCII: an ASCII character is classed by the caller's table (built from that regex);
any other code point is a word character if ``Py_UNICODE_ISALNUM`` holds (what ``re``'s
``\\w`` tests), space if ``Py_UNICODE_ISSPACE`` holds (``re``'s ``\\s``), else a token of
its own. A token's hash is the crc32 of its UTF-8 bytes, as ``zlib.crc32(token.encode())``.
"""

import array
import itertools

from cpython.unicode cimport Py_UNICODE_ISALNUM, Py_UNICODE_ISSPACE
from libc.math cimport isnan
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL


# Character classes, the values of the caller's ASCII table.
cdef enum:
    C_SPACE = 0
    C_WORD = 1
    C_OTHER = 2

# What the number rule needs to know of a window token (str methods of the token).
cdef enum:
    F_DECIMAL = 1  # isdecimal(): a number whose value float() reads
    F_DIGIT = 2    # isdigit(): ends a look-ahead
    F_ALNUM = 4    # isalnum()
    F_HYPHEN = 8   # the token "-", which does not end a look-ahead

SPACE, WORD, OTHER = C_SPACE, C_WORD, C_OTHER


cdef struct Span:
    Py_ssize_t start   # byte offset in the UTF-8 text
    Py_ssize_t size    # bytes
    uint32_t crc


# crc32 (zlib's polynomial), four table lookups per four bytes ("slice by 4").
cdef uint32_t CRC[4][256]


cdef void _fill_crc_tables():
    cdef uint32_t c
    cdef int i, k, t
    for i in range(256):
        c = i
        for k in range(8):
            c = (c >> 1) ^ 0xEDB88320U if c & 1 else c >> 1
        CRC[0][i] = c
    for i in range(256):
        for t in range(1, 4):
            CRC[t][i] = (CRC[t - 1][i] >> 8) ^ CRC[0][CRC[t - 1][i] & 0xFF]


_fill_crc_tables()


cdef inline uint32_t _crc32(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint32_t c = 0xFFFFFFFFU
    while n >= 4:
        c ^= (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
              | (<uint32_t>p[3] << 24))
        c = (CRC[3][c & 0xFF] ^ CRC[2][(c >> 8) & 0xFF] ^ CRC[1][(c >> 16) & 0xFF]
             ^ CRC[0][c >> 24])
        p += 4
        n -= 4
    while n > 0:
        c = CRC[0][(c ^ p[0]) & 0xFF] ^ (c >> 8)
        p += 1
        n -= 1
    return c ^ 0xFFFFFFFFU


def crc32(bytes data):
    """crc32 of ``data``, as ``zlib.crc32(data)`` (the kernel's own, exposed for tests)."""
    return _crc32(<const uint8_t*><const char*>data, len(data))


cdef inline int _class_above_ascii(const uint8_t* s, Py_ssize_t i,
                                   Py_ssize_t* width) noexcept:
    """Class of the non-ASCII code point at byte ``i`` of valid UTF-8; its bytes in
    ``width``."""
    cdef uint8_t b = s[i]
    cdef Py_UCS4 cp
    if b < 0xE0:
        cp = ((b & 0x1F) << 6) | (s[i + 1] & 0x3F)
        width[0] = 2
    elif b < 0xF0:
        cp = ((b & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F)
        width[0] = 3
    else:
        cp = (((b & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6)
              | (s[i + 3] & 0x3F))
        width[0] = 4
    if Py_UNICODE_ISALNUM(cp):
        return C_WORD
    if Py_UNICODE_ISSPACE(cp):
        return C_SPACE
    return C_OTHER


cdef class FeatureKernel:
    """Tables of one featuriser; ``run`` featurises one prompt. Not thread-safe (scratch
    buffers are owned by the kernel): one per featuriser.

    ``ascii_classes``: 128 bytes, the class of each ASCII character (SPACE, WORD, OTHER).
    ``words``: the words the rules look up, as UTF-8; per word its ``numbers`` value (NaN
    if not a number word), its ``units`` index (-1 if not a unit) and its ``masks`` bits
    (indicators it sets alone). ``pairs``: (first word, second word, mask) of the two-word
    indicators. ``counted``: ASCII characters, none a word character, whose occurrences
    are counted.
    """

    cdef uint8_t ascii_class[128]
    cdef Py_ssize_t num_dims, window, lookahead, num_units
    cdef bytes counted
    cdef bytes spelling      # the words' UTF-8, one after another
    cdef int64_t[::1] word_start, word_size
    cdef double[::1] number
    cdef int32_t[::1] unit
    cdef int64_t[::1] mask
    cdef int32_t[::1] pair_first, pair_second
    cdef int64_t[::1] pair_mask
    cdef uint32_t[::1] word_crc
    cdef int32_t[::1] table  # open addressing by crc: word index + 1, 0 = empty
    cdef Span* spans         # first `window` tokens, then a ring of the last `window`
    cdef Span* win           # the window, in order
    cdef int32_t* win_word
    cdef uint8_t* win_flags

    def __cinit__(self, bytes ascii_classes, list words, list numbers, list units,
                  list masks, list pairs, Py_ssize_t num_dims, Py_ssize_t window,
                  Py_ssize_t lookahead, Py_ssize_t num_units, bytes counted):
        cdef Py_ssize_t i, size, k
        if (len(ascii_classes) != 128 or max(ascii_classes) > C_OTHER or num_dims < 1
                or num_dims > 1 << 31 or window < 1 or lookahead < 0
                or not len(numbers) == len(units) == len(masks) == len(words)
                or not all(-1 <= u < num_units for u in units)
                or not all(0 <= p[0] < len(words) and 0 <= p[1] < len(words) for p in pairs)):
            raise ValueError("FeatureKernel: inconsistent tables")
        if not all(0 <= c < 128 and ascii_classes[c] != C_WORD for c in counted):
            raise ValueError("FeatureKernel: counted characters must be ASCII, not \\w")
        for i in range(128):
            self.ascii_class[i] = ascii_classes[i]
        self.num_dims, self.window, self.lookahead = num_dims, window, lookahead
        self.num_units, self.counted = num_units, counted
        self.spelling = b"".join(words)
        sizes = [len(w) for w in words]
        self.word_size = _array("q", sizes)
        self.word_start = _array("q", [0, *itertools.accumulate(sizes)][:-1])
        self.number = _array("d", numbers)
        self.unit = _array("i", units)
        self.mask = _array("q", masks)
        self.pair_first = _array("i", [p[0] for p in pairs])
        self.pair_second = _array("i", [p[1] for p in pairs])
        self.pair_mask = _array("q", [p[2] for p in pairs])
        self.word_crc = _array("I", [_crc32(<const uint8_t*><const char*>w, len(w))
                                     for w in words])
        size = 16
        while size < 4 * len(words):
            size *= 2
        self.table = _array("i", [0] * size)
        for i in range(len(words)):
            k = self.word_crc[i] & (size - 1)
            while self.table[k]:
                k = (k + 1) & (size - 1)
            self.table[k] = i + 1
        self.spans = <Span*>malloc(2 * window * sizeof(Span))
        self.win = <Span*>malloc(2 * window * sizeof(Span))
        self.win_word = <int32_t*>malloc(2 * window * sizeof(int32_t))
        self.win_flags = <uint8_t*>malloc(2 * window)
        if not (self.spans and self.win and self.win_word and self.win_flags):
            raise MemoryError()

    def __dealloc__(self):
        free(self.spans)
        free(self.win)
        free(self.win_word)
        free(self.win_flags)

    cdef int32_t _word(self, const uint8_t* s, Span sp) noexcept:
        """Index of the word spelled by the span, or -1."""
        cdef Py_ssize_t mask = self.table.shape[0] - 1
        cdef Py_ssize_t k = sp.crc & mask
        cdef int32_t w
        cdef const char* spelling = self.spelling
        while self.table[k]:
            w = self.table[k] - 1
            if (self.word_crc[w] == sp.crc and self.word_size[w] == sp.size
                    and memcmp(spelling + self.word_start[w], s + sp.start, sp.size) == 0):
                return w
            k = (k + 1) & mask
        return -1

    cdef uint8_t _flags(self, const uint8_t* s, Span sp):
        """``F_*`` flags of a token: in C for ASCII, by the str methods otherwise."""
        cdef Py_ssize_t j
        cdef uint8_t b
        cdef bint digits = True, alnum = True
        for j in range(sp.size):
            b = s[sp.start + j]
            if b >= 0x80:
                tok = (<const char*>s)[sp.start:sp.start + sp.size].decode("utf-8")
                return ((F_DECIMAL if tok.isdecimal() else 0) | (F_DIGIT if tok.isdigit() else 0)
                        | (F_ALNUM if tok.isalnum() else 0))
            if not (48 <= b <= 57):
                digits = False
                if not (97 <= b <= 122 or 65 <= b <= 90):
                    alnum = False
        if sp.size == 1 and s[sp.start] == 45:  # "-"
            return F_HYPHEN
        return (F_DECIMAL | F_DIGIT if digits else 0) | (F_ALNUM if alnum else 0)

    def run(self, str lowered, double[::1] hashed):
        """Featurise one lower-cased prompt. Writes the signed token counts per bucket,
        divided by the token count, into ``hashed`` (``num_dims`` values) and returns
        ``(num_tokens, num_chars, counts, found, requested)``: tokens, their characters,
        the occurrences of each ``counted`` character (a non-space one is a token each
        time), the OR of the masks of the words and pairs in the window, and per unit the
        largest number that asks for it there (0.0 if none)."""
        cdef Py_ssize_t n, i = 0, start, width, chars, ntok = 0, nchars = 0, ring = 0
        cdef Py_ssize_t W = self.window
        cdef uint32_t D = <uint32_t>self.num_dims, crc, slot
        cdef bint pow2 = (D & (D - 1)) == 0
        cdef const uint8_t* ascii = self.ascii_class
        cdef const uint8_t* s
        cdef double* sums
        cdef uint8_t b
        cdef int cls
        cdef int64_t seen[128]  # occurrences of each ASCII character that is not \w
        cdef Span sp
        if hashed.shape[0] != self.num_dims:
            raise ValueError(f"hashed has {hashed.shape[0]} values, the kernel {D}")
        s = <const uint8_t*>PyUnicode_AsUTF8AndSize(lowered, &n)
        sums = &hashed[0]
        for i in range(D):
            sums[i] = 0.0
        for i in range(128):
            seen[i] = 0
        i = 0
        while i < n:
            b = s[i]
            if b < 0x80:
                cls = ascii[b]
                width = 1
                if cls != C_WORD:
                    seen[b] += 1
            else:
                cls = _class_above_ascii(s, i, &width)
            if cls == C_SPACE:
                i += width
                continue
            start = i
            i += width
            chars = 1
            if cls == C_WORD:
                while i < n:
                    b = s[i]
                    if b < 0x80:
                        if ascii[b] != C_WORD:
                            break
                        i += 1
                    elif _class_above_ascii(s, i, &width) == C_WORD:
                        i += width
                    else:
                        break
                    chars += 1
            crc = _crc32(s + start, i - start)
            # the index is the hash modulo the dimensions, the sign its top bit (token_slot)
            slot = crc & (D - 1) if pow2 else crc % D
            sums[slot] += -1.0 if crc & 0x80000000U else 1.0
            sp.start, sp.size, sp.crc = start, i - start, crc
            if ntok < W:
                self.spans[ntok] = sp
            else:  # a ring of the last W tokens
                self.spans[W + ring] = sp
                ring = ring + 1 if ring + 1 < W else 0
            ntok += 1
            nchars += chars
        for i in range(D):
            sums[i] = sums[i] / <double>(ntok if ntok > 1 else 1)
        found, requested = self._window_rules(s, ntok)
        return ntok, nchars, tuple([seen[c] for c in self.counted]), found, requested

    cdef tuple _window_rules(self, const uint8_t* s, Py_ssize_t ntok):
        """The indicator masks and requested lengths read in the window: the first and
        the last ``window`` tokens (all tokens if there are at most twice as many)."""
        cdef Py_ssize_t W = self.window, m = 0, j, k
        cdef int64_t found = 0
        for j in range(min(ntok, W)):
            self.win[m] = self.spans[j]
            m += 1
        for j in range(max(W, ntok - W), ntok):
            self.win[m] = self.spans[W + (j - W) % W]
            m += 1
        for j in range(m):
            self.win_word[j] = self._word(s, self.win[j])
            self.win_flags[j] = self._flags(s, self.win[j])
            if self.win_word[j] >= 0:
                found |= self.mask[self.win_word[j]]
        for j in range(m - 1):
            if self.win_word[j] >= 0 and self.win_word[j + 1] >= 0:
                for k in range(self.pair_first.shape[0]):
                    if (self.pair_first[k] == self.win_word[j]
                            and self.pair_second[k] == self.win_word[j + 1]):
                        found |= self.pair_mask[k]
        return found, self._requested(s, m)

    cdef list _requested(self, const uint8_t* s, Py_ssize_t m):
        """Per unit, the largest number followed within ``lookahead`` tokens by the unit,
        the look-ahead ending at another number or a token neither alphanumeric nor "-"."""
        cdef list found = [0.0] * self.num_units
        cdef Py_ssize_t j, k
        cdef int32_t w, u
        cdef double value
        cdef Span sp
        for j in range(m):
            w = self.win_word[j]
            if not ((w >= 0 and not isnan(self.number[w])) or self.win_flags[j] & F_DECIMAL):
                continue
            for k in range(j + 1, min(j + 1 + self.lookahead, m)):
                u = self.unit[self.win_word[k]] if self.win_word[k] >= 0 else -1
                if u >= 0:
                    if w >= 0 and not isnan(self.number[w]):
                        value = self.number[w]
                    else:  # float() of the token itself: the same rounding, inf if huge
                        sp = self.win[j]
                        value = float((<const char*>s)[sp.start:sp.start + sp.size]
                                      .decode("utf-8"))
                    if value > <double>found[u]:
                        found[u] = value
                    break
                if ((self.win_word[k] >= 0 and not isnan(self.number[self.win_word[k]]))
                        or self.win_flags[k] & F_DIGIT
                        or not self.win_flags[k] & (F_ALNUM | F_HYPHEN)):
                    break
        return found


def _array(str typecode, values):
    return array.array(typecode, values)
