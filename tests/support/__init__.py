"""Helpers the tests share (and the benches import): nothing here imports a test or a bench."""
