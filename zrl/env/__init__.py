"""Verifiable environments: the registry (name → factory) and its plugin discovery."""

from zrl.env.registry import EnvironmentInfo, Registry, UnknownEnvironmentError, registry

__all__ = ["EnvironmentInfo", "Registry", "UnknownEnvironmentError", "registry"]
