"""Verifiable environments: the plugin base class and the registry (name → factory) with discovery."""

from zrl.env.base import Environment, extract_answer, in_split, safe_verify, safe_verify_group, verifies_groups
from zrl.env.episode import Episode, EpisodicEnvironment, Turn
from zrl.env.registry import EnvironmentInfo, Registry, UnknownEnvironmentError, registry

__all__ = ["Environment", "EnvironmentInfo", "Episode", "EpisodicEnvironment", "Turn", "Registry", "UnknownEnvironmentError", "extract_answer", "in_split",
           "registry", "safe_verify", "safe_verify_group", "verifies_groups"]
