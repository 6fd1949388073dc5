"""The ``olproute`` command line."""
