"""Stub of the compiled batch-formation kernel (olproute/_core.pyx)."""

from typing import Any

import numpy as np
import numpy.typing as npt

FIRST_TOKEN: int
FINISHED: int
NUM_SUMS: int

_Sums = tuple[float, float, float, float, float, float, float, float]
_IntArray = npt.NDArray[np.int64]

class BatchCore:
    capacity: int
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        capacity: int = ...,
    ) -> None: ...
    def add_request(self, prompt_tokens: int, max_output_tokens: int,
                    computed_tokens: int = 0) -> int: ...
    def release_slot(self, slot: int) -> None: ...
    def abort(self, slot: int) -> None: ...
    def schedule(self) -> tuple[int, _Sums]: ...
    def commit(self) -> int: ...
    def events(self) -> tuple[_IntArray, _IntArray]: ...
    def event_list(self) -> list[tuple[int, int]]: ...
    def batch(self) -> tuple[_IntArray, _IntArray, _IntArray, _IntArray]: ...
    def preempted(self) -> _IntArray: ...
    def running(self) -> _IntArray: ...
    def waiting(self) -> _IntArray: ...
    def request(self, slot: int) -> tuple[int, int, int, int, int, int]: ...
    def snapshot(
        self, predicted_by_slot: _IntArray, id_by_slot: _IntArray
    ) -> tuple[_IntArray, _IntArray, int, int, _IntArray]: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...

def replay_ttft(
    snapshots: list[Any],
    limits: _IntArray,
    beta: npt.NDArray[np.float64],
    new_prompt: int,
    new_decode: _IntArray,
    now_s: float,
    extras: list[npt.NDArray[np.float64] | None] | None = ...,
    max_batches: int = ...,
    loads: npt.NDArray[np.float64] | None = ...,
) -> npt.NDArray[np.float64]: ...

def replay_ttft_many(
    snapshots: list[Any],
    limits: _IntArray,
    beta: npt.NDArray[np.float64],
    new_prompts: _IntArray,
    new_decode: _IntArray,
    now_s: float,
    extras: list[npt.NDArray[np.float64] | None] | None = ...,
    max_batches: int = ...,
    loads: npt.NDArray[np.float64] | None = ...,
) -> npt.NDArray[np.float64]: ...
