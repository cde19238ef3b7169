"""Definitions → validated, hashed, versioned registry state."""

from featurestore.registry.loader import Definitions, load_definitions
from featurestore.registry.plan import Change, Plan, make_plan
from featurestore.registry.store import RegistryStore

__all__ = ["Definitions", "load_definitions", "Change", "Plan", "make_plan", "RegistryStore"]
