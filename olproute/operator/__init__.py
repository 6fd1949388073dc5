"""Offline tools for operators: tuning the objective's weights over a grid, its plots, and
the executors that run independent points in worker processes or as Ray tasks."""
