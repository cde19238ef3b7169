"""Errors users act on. Each message says what is wrong and what to change."""

from __future__ import annotations


class FeatureStoreError(Exception):
    """Base class: the CLI prints these without a traceback."""


class DefinitionError(FeatureStoreError):
    """One or more feature definitions are invalid; ``problems`` lists every one."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        super().__init__(f"{count} in the feature definitions:\n" + "\n".join(f"  - {p}" for p in problems))


class NotFoundError(FeatureStoreError):
    """A named view, feature, service or source does not exist."""


class RequestError(FeatureStoreError):
    """A lookup or retrieval request is malformed (missing keys, wrong types, too large)."""


class OnlineStoreUnavailable(FeatureStoreError):
    """The online store cannot be reached."""


class StorageUnavailable(FeatureStoreError):
    """Object storage refused a request or could not be reached (``storage.explain`` says which)."""


class BadRowsError(FeatureStoreError):
    """Source rows broke the schema and the run was asked to fail on them."""


class ForbiddenError(FeatureStoreError):
    """The caller's API key lacks the scope an action needs."""


class ConflictError(FeatureStoreError):
    """The request conflicts with an earlier one (an idempotency key reused for other rows, a job already running)."""


class NotRetainedError(ConflictError):
    """A replay (a lookup ``at`` a past time) reaches back to events the online store no longer
    keeps (``online_store.event_retention``): history has them."""


class OnDemandError(FeatureStoreError):
    """An on-demand view's function failed or returned something its schema does not allow."""
