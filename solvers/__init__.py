"""The exact LP behind bid-price routing, and the duality check of online prices.

- ``solvers.problem``: the LP's data (a window of requests on an absolute slot grid,
  three priced resources: batch slots, KV cache, compute) and its columns, with the
  reward terms of ``olproute.pricing.reward`` evaluated for every start slot;
- ``solvers.lp``: the LP as one sparse matrix passed to HiGHS (``highspy``), solved in
  one shot or by column generation, with primal, duals, status and timings;
- ``solvers.cvx``: the same LP written plainly in cvxpy (tests, small offline studies);
- ``solvers.certificate``: the dual value D(p) of any prices p >= 0, the certificate
  D(p)/LP* - 1, the online policy's realised reward and its gap to LP*;
- ``solvers.record``: a ``bid_price`` run with its window and price history recorded
  (``WindowLog``, plain arrays) and the LP of a window of it (``build_window``);
- ``solvers.check``: ``olproute lp-check`` (record, solve, certify, plot);
- ``solvers.compare``: online prices vs the LP in batch-, KV- and compute-bound scenarios.
- ``solvers.learn``: the online price step run as an LP dual solver on one window.

Heavy imports (highspy, cvxpy, matplotlib) happen inside the functions that need them.
"""
