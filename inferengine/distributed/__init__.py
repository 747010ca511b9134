"""Tensor-parallel groups and collectives (a single rank unless an executor sets more)."""
