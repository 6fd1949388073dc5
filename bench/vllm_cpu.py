"""Build the tiny model real vLLM serves on this CPU (``tests/support/vllm_cpu.py``).

    python bench/vllm_cpu.py MODEL_DIR [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's bench, olproute
from bench.common import add_harness_args, begin, write_results
from tests.support.vllm_cpu import build_tiny_model


def main() -> int:
    """``python bench/vllm_cpu.py DIR``: build the tiny model's folder in DIR."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    add_harness_args(ap)
    args = ap.parse_args()
    begin(args, ap)
    path = build_tiny_model(args.model_dir)
    print(path)
    write_results(args.json, {"model_dir": str(path)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
