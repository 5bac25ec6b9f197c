"""The package version (one place: the package, its reports and run directories read it)."""
__version__ = "0.1.0"
