"""olproute: a request router for LLM serving by online linear programming with bid-price
control, a batch-formation TTFT estimator, and a cluster simulator that runs every policy
on the same workload."""

__version__ = "0.1.0"
