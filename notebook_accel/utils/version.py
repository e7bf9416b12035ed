"""The package version, at the floor so that any layer can report it without importing the root."""

__version__ = "0.1.0"
