"""From a request to a decision: the router (no I/O), the one assembly place that builds a
policy, tracked snapshots, the prefix index, per-request outlook, prefill/decode pools and
the live window the exact LP checks."""
