"""The package version (the root package re-exports it; lower rooms import it from here)."""

__version__ = "0.1.0"
