"""Emulator of CML's ``cml`` package for tests; see workers_v1."""
