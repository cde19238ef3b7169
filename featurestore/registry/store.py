"""The applied registry state: a history of versions, the current one, watermarks, run ids.

Layout under the registry location (a local folder or ``s3://bucket/prefix``)::

    history/v00001.json      every applied version, immutable, written put-if-absent: the log
    registry.json            the current applied state (version, time, every object's spec +
                             hash, each view's history version and join-key types): a copy of
                             the newest history entry, moved forward by compare-and-swap
    watermarks.json          per-view materialization progress (compare-and-swap)
    run_seq                  monotonic counter giving each write run a unique ingest id (compare-and-swap)

Many writers on many machines: an ``apply`` claims version N+1 by creating ``history/vN+1``
(``If-None-Match: *``); one that finds it taken re-reads and re-plans. An apply that died between
its history entry and ``registry.json`` is rolled forward by the next one, so the two converge.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from featurestore.errors import ConflictError, FeatureStoreError
from featurestore.storage import Location, update

CURRENT = "registry.json"
WATERMARKS = "watermarks.json"
RUN_SEQ = "run_seq"


@dataclass(frozen=True)
class Watermark:
    """One view's materialization progress."""

    online_synced: bool = False  # the online store holds the view's whole history, under ``online_layout``
    online_layout: str | None = None  # the layout id (``ViewLayout.storage_id``) the online store was filled under
    # the token the write that left the online store in sync left there too (``OnlineWrites.set_sync_token``):
    # a store without it (emptied, replaced, restored from an older copy) lacks rows of the history
    online_token: str | None = None
    last_run_id: int | None = None  # the last write run that committed history
    materialized_at: str | None = None  # when it did (ISO, UTC)
    end: str | None = None  # the end of the last materialized interval (ISO)
    max_event_timestamp: str | None = None  # the newest event it stored (ISO)

    def synced_under(self, storage_id: str) -> bool:
        """Whether the online store holds the whole history in this layout (another layout: nothing of it)."""
        return self.online_synced and self.online_layout == storage_id

    def token_kept(self, stored: str | None) -> bool:
        """Whether an online store holding ``stored`` as the view's sync token is the one this mark's
        fill left it in (an emptied, replaced or restored one lacks it; a mark older than tokens has none)."""
        return self.online_token is not None and stored == self.online_token

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Watermark:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # fields older versions wrote are dropped


def _history_key(number: int) -> str:
    return f"history/v{number:05d}.json"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True, default=str).encode()


class RegistryStore:
    """Persisted applied state of one repo, on local disk or object storage."""

    def __init__(self, location: Location | Path):
        self.location = location if isinstance(location, Location) else Location(str(Path(location).resolve()))
        self.objects = self.location.objects()

    def _read(self, key: str) -> Any:
        """A registry object, or an error naming it and the way out (objects are written whole, so
        a damaged one was edited or truncated by something else)."""
        found = self.objects.get(key)
        if found is None:
            return None
        try:
            return json.loads(found[0])
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FeatureStoreError(
                f"registry file {self.location.child(key)} is damaged ({exc}); restore it from "
                f"{self.location.child('history')} (every applied version is kept there) or from a backup, "
                "or move it away and run `featurestore apply` again"
            ) from None

    def current(self) -> dict[str, Any]:
        state = self._read(CURRENT)
        return state if state is not None else {"version": 0, "applied_at": None, "objects": {}}

    def stamp(self) -> str | None:
        """Changes whenever ``current`` does (an etag or file stamp: no read of the state)."""
        return self.objects.stamp(CURRENT)

    def version(self, number: int) -> dict[str, Any]:
        state = self._read(_history_key(number))
        if state is None:
            raise FileNotFoundError(f"registry version {number} not found in {self.location.child('history')}")
        return state

    def versions(self) -> list[int]:
        return [int(k.rsplit("/v", 1)[1].split(".")[0]) for k in self.objects.keys("history/v") if k.endswith(".json")]

    def apply(
        self, objects: dict[str, dict[str, dict]], expected_version: int | None = None, **derived: Any
    ) -> dict[str, Any]:
        """Record a new applied state; ``derived``: what the plan resolved with it (each view's
        history version and join-key types), so an older state can be read back as it was.
        ``expected_version``: the version the plan was made against; if another apply came first,
        ``ConflictError`` (plan again)."""
        while True:
            number = self._rolled_forward()
            if expected_version is not None and number != expected_version:
                raise ConflictError(
                    f"the registry moved to version {number} since this plan was made against "
                    f"version {expected_version}; plan again"
                )
            state = {"version": number + 1, "applied_at": datetime.now(UTC).isoformat(), "objects": objects, **derived}
            data = _dumps(state)
            if self.objects.put(_history_key(number + 1), data, if_absent=True) is not None:
                self._point_to(state["version"], data)
                return state
            # another apply claimed that version: re-read (and, with an expected version, refuse)

    def _rolled_forward(self) -> int:
        """The current version, after moving ``registry.json`` up to the newest history entry (an
        apply that stopped between the two)."""
        number = self.current()["version"]
        while (entry := self.objects.get(_history_key(number + 1))) is not None:
            self._point_to(number + 1, entry[0])
            number += 1
        return number

    def _point_to(self, number: int, data: bytes) -> None:
        """``registry.json`` := history entry ``number``, unless it already is that or newer."""

        def change(current: bytes | None) -> bytes | None:
            at = json.loads(current)["version"] if current is not None else 0
            return data if at < number else None

        update(self.objects, CURRENT, change)

    # -- materialization progress

    def watermarks(self) -> dict[str, Watermark]:
        return {view: Watermark.from_json(mark) for view, mark in (self._read(WATERMARKS) or {}).items()}

    def watermark(self, view: str) -> Watermark:
        """The view's progress (an empty one before its first run)."""
        return self.watermarks().get(view, Watermark())

    def set_watermark(self, view: str, **values: Any) -> None:
        """Change the named fields of the view's watermark (a name ``Watermark`` lacks is a TypeError)."""
        replace(Watermark(), **values)  # the names checked before anything is written
        self._change_watermarks(lambda marks: {**marks, view: replace(marks.get(view, Watermark()), **values)})

    def drop_watermark(self, view: str) -> None:
        self._change_watermarks(lambda marks: {v: m for v, m in marks.items() if v != view})

    def _change_watermarks(self, change: Any) -> None:
        def apply(current: bytes | None) -> bytes:
            raw = json.loads(current) if current is not None else {}
            marks = change({view: Watermark.from_json(mark) for view, mark in raw.items()})
            return _dumps({v: {k: x for k, x in asdict(m).items() if x is not None} for v, m in marks.items()})

        update(self.objects, WATERMARKS, apply)

    def next_run_id(self) -> int:
        """A number no earlier write run got, on any machine; orders runs for the ingest tie-break."""
        written = update(self.objects, RUN_SEQ, lambda current: str(int(current or 0) + 1).encode())
        return int(written or 0)
