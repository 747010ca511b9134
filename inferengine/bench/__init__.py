"""Serving benchmark client and paired-run orchestration (talks to servers over HTTP only)."""
