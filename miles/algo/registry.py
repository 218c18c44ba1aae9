"""A small name -> object registry used for every algorithm variant (advantages, policy losses, reductions).

Variants are registered with a decorator and looked up by the name the user gives on the command line, so
dispatch never grows an if/elif chain and a typo produces an error that lists the valid choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to registered objects of one kind (`kind` is used in error messages only).

    >>> losses = Registry("policy loss")
    >>> @losses.register("ppo")
    ... def ppo(): ...
    >>> losses.get("ppo") is ppo
    True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its target under `name`; returns the target unchanged.

        Raises ValueError if `name` is empty or already registered (a duplicate is always a bug: two variants
        silently shadowing each other would make the behaviour depend on import order).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; registered: {self.names()}")

        def decorator(obj: T) -> T:
            if name in self._entries:  # registered between decorator creation and application
                raise ValueError(f"{self.kind} {name!r} is already registered; registered: {self.names()}")
            self._entries[name] = obj
            return obj

        return decorator

    def add(self, name: str, obj: T) -> T:
        """Register `obj` under `name` without decorator syntax (same duplicate rule)."""
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        """The object registered under `name`; ValueError listing the registered names on a miss."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
