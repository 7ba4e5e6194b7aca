"""The package's version, in one place: pyproject.toml reads it, and so does `redline doctor`."""

__version__ = "0.1.0"
