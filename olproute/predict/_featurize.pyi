"""Stub of the compiled prompt featuriser kernel (olproute/predict/_featurize.pyx)."""

import numpy as np
import numpy.typing as npt

SPACE: int
WORD: int
OTHER: int

def crc32(data: bytes) -> int: ...

class FeatureKernel:
    def __init__(
        self,
        ascii_classes: bytes,
        words: list[bytes],
        numbers: list[float],
        units: list[int],
        masks: list[int],
        pairs: list[tuple[int, int, int]],
        num_dims: int,
        window: int,
        lookahead: int,
        num_units: int,
        counted: bytes,
    ) -> None: ...
    def run(
        self, lowered: str, hashed: npt.NDArray[np.float64]
    ) -> tuple[int, int, tuple[int, ...], int, list[float]]: ...
