"""The engine core step loop, its clients, and input/output processing."""
