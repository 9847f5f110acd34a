"""The installed package's version: one source of truth, the version in pyproject.toml."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    try:
        return metadata.version("reasonkv")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"
