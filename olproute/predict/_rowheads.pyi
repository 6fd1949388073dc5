"""Stub of the LightGBM single-row kernel (olproute/predict/_rowheads.pyx)."""

import numpy as np
import numpy.typing as npt

def predict_rows(
    function: int, config: int, x: npt.NDArray[np.float64], num_features: int
) -> list[float]: ...
