"""Traces kept across processes: the key, the store, JSON formats, fingerprints."""
