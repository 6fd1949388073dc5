"""Benchmark of the request path's prompt hashing
(``olproute.routing.prefix_index.text_block_hashes``).

    python bench/bench_prefix_hash.py [--words N ...] [--block-size B] [--repeat R]

For prompts of N whitespace words (default 500, 2,000 and 7,000), the time to hash them in
blocks of B words (default 16), and for reference, measured in the same run, the time of
``str.split`` of the same text (``count_words``, which the request path pays already) and
of one ``PrefixIndex.match`` of the hashes over 8 instances that hold them. Each figure is
the best of R rounds (default 15) of enough calls to last about 50 ms: the machine's
noise only ever adds time. Absolute microseconds differ about 2x between machines; the
ratio to ``str.split`` is what to compare.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from olproute.routing.prefix_index import PrefixIndex, text_block_hashes
from olproute.types import InstanceSpec


def best_us(fn: Callable[[], object], repeat: int) -> float:
    """The best time of one call in microseconds, over ``repeat`` rounds."""
    number, _ = timeit.Timer(fn).autorange()
    number = max(1, number // 4)   # autorange aims at 0.2 s a round; 50 ms is enough
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _index(hashes_per_instance: int, block_size: int) -> PrefixIndex:
    spec = InstanceSpec(name="i", model="m", gpu="g", tensor_parallel=1, max_num_seqs=256,
                        max_num_batched_tokens=2048, block_size=block_size,
                        num_kv_blocks=max(hashes_per_instance, 1) * 4)
    return PrefixIndex([spec] * 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, nargs="+", default=[500, 2000, 7000])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=15)
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    rows = []
    bs = args.block_size
    print(f"{'words':>6} {'blocks':>6} {'hash us':>9} {'split us':>9} {'hash/split':>10} "
          f"{'match us':>9}")
    for n in args.words:
        text = " ".join(f"w{i % 997}x{i // 997}" for i in range(n))
        hashes = text_block_hashes(text, bs)
        index = _index(len(hashes), bs)
        for g in range(8):
            index.routed(g, hashes)
        hash_us = best_us(partial(text_block_hashes, text, bs), args.repeat)
        split_us = best_us(text.split, args.repeat)
        match_us = best_us(partial(index.match, hashes, n), args.repeat)
        print(f"{n:>6} {len(hashes):>6} {hash_us:>9.1f} {split_us:>9.1f} "
              f"{hash_us / split_us:>10.2f} {match_us:>9.1f}")
        rows.append({"words": n, "blocks": len(hashes), "hash_us": hash_us,
                     "split_us": split_us, "match_us": match_us})
    write_results(args.json, {"block_size": bs, "repeat": args.repeat, "rows": rows})


if __name__ == "__main__":
    main()
