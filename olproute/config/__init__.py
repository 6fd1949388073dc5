"""Configuration: the schema (typed, bounded, documented keys), reading YAML files, weight
profiles, and the loader that resolves policy names and parameters."""
