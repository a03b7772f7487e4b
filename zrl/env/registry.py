"""Registry of verifiable environments: explicit name → factory, with plugin discovery.

Environments come from three places, in this order of precedence:
1. `registry.register(name, factory)` calls made by code the user imports;
2. the `zrl.environments` entry-point group of installed packages (`name = "module:Class"`), found
   the first time a name is looked up or listed, and each imported only when its name is looked up
   (or the names are listed): a process that builds one environment imports that one's module only;
3. a `module:Class` reference written directly in a recipe.
Registering a name twice raises; looking up an unknown name raises and lists the valid names.
An entry point that cannot be loaded (its module is missing or raises at import, or lacks the class)
is skipped with a one-line warning naming it, and looking it up raises with the reason: one broken
package must not hide every other environment.
A factory may declare `description` (else the first docstring line) and `reward_type`
("binary" | "continuous"), which the recipe checks against its advantage estimator.
"""

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

ENTRY_POINT_GROUP = "zrl.environments"

log = logging.getLogger("zrl")


class UnknownEnvironmentError(LookupError):
    pass


@dataclass(frozen=True)
class EnvironmentInfo:
    name: str
    factory: Callable[..., Any]
    source: str  # "registered" | "entry point <dist>" | "reference"

    @property
    def description(self) -> str:
        text = getattr(self.factory, "description", None) or (self.factory.__doc__ or "").strip()
        return text.splitlines()[0] if text else ""

    @property
    def reward_type(self) -> str | None:
        return getattr(self.factory, "reward_type", None)

    @property
    def uses_reward_model(self) -> bool:
        """Whether it scores with the recipe's reward model (its actors must be up; a rollout worker hosts none)."""
        return getattr(self.factory, "uses_reward_model", False)


def load_reference(reference: str) -> Callable[..., Any]:
    """Import `package.module:Attribute`; raises UnknownEnvironmentError with the reason."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise UnknownEnvironmentError(f"{reference!r} is not a `module:Class` reference")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownEnvironmentError(f"{reference!r}: cannot import {module_name!r} ({exc})") from None
    except Exception as exc:  # a plugin's module may raise anything at import; it is the user's code
        raise UnknownEnvironmentError(
            f"{reference!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UnknownEnvironmentError(f"{reference!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    return target


class Registry:
    def __init__(self, group: str = ENTRY_POINT_GROUP):
        self._group = group
        self._entries: dict[str, EnvironmentInfo] = {}
        self._unloaded: dict[str, tuple[str, str]] | None = None  # entry points not imported: name -> (value, dist)

    def register(self, name: str, factory: Callable[..., Any], source: str = "registered") -> None:
        if name in self._entries or name in self._entry_points():
            source_of = self._entries[name].source if name in self._entries else "entry point"
            raise ValueError(f"environment {name!r} is already registered ({source_of})")
        self._entries[name] = EnvironmentInfo(name, factory, source)

    def get(self, name: str) -> EnvironmentInfo:
        if ":" in name:
            return EnvironmentInfo(name, load_reference(name), "reference")
        if name in self._entry_points():
            value, dist = self._unloaded.pop(name)
            try:
                self._entries[name] = EnvironmentInfo(name, load_reference(value), f"entry point {dist}")
            except UnknownEnvironmentError as exc:
                raise UnknownEnvironmentError(f"environment {name!r} (entry point of {dist}) cannot be loaded: "
                                              f"{exc}") from None
        if name not in self._entries:
            valid = ", ".join(self.names()) or "none registered"
            raise UnknownEnvironmentError(
                f"unknown environment {name!r}; valid names: {valid} (or use a `module:Class` reference)")
        return self._entries[name]

    def names(self) -> list[str]:
        """Every environment that loads: the entry points not imported yet are imported now, and one that
        fails is skipped with a warning."""
        for name in list(self._entry_points()):
            try:
                self.get(name)
            except UnknownEnvironmentError as exc:
                log.warning("skipping environment %r: %s", name, exc)
        return sorted(self._entries)

    def _entry_points(self) -> dict[str, tuple[str, str]]:
        """The group's entry points not imported yet (found once, from the installed packages' metadata)."""
        if self._unloaded is None:
            self._unloaded = {}
            for ep in entry_points(group=self._group):
                if ep.name in self._entries or ep.name in self._unloaded:
                    raise ValueError(f"environment {ep.name!r} is provided twice (entry point {ep.value!r})")
                self._unloaded[ep.name] = (ep.value, ep.dist.name if ep.dist else "?")
        return self._unloaded


registry = Registry()
