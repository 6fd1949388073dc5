"""The price of capacity: the multi-objective reward and usage columns (with the compiled
score kernel and its reference twin), and the shadow prices learned online."""
