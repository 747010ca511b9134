"""Prometheus instruments and the stats that feed them."""
