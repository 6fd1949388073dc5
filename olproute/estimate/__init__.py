"""TTFT estimation: BEA (the batch-formation replay), batch-time calibration (NNLS fit,
online refit from a backend's streams) and the profiling sweep of live backends."""
