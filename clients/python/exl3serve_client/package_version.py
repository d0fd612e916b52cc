"""The installed exl3serve package's version, as every command prints it for --version."""
from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("exl3serve")
    except PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"
