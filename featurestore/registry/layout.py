"""Where an applied view version's rows live: its history table and its online field.

Users' ``FeatureView`` objects say what a view computes; the registry decides which version
of it is applied (a change that makes stored rows wrong starts a new version, see
``registry.plan``), and each store names that version's storage: the offline store a table
(``offline.base.history_table``), the online store a field carrying the layout's hash
(``online.base.online_field``). Nothing here is set on the user's objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from featurestore.definitions import FeatureView
from featurestore.offline.base import history_table
from featurestore.online.base import layout_id, online_field


@dataclass(frozen=True)
class ViewLayout:
    """The storage of one applied view version."""

    version: int
    history_table: str  # the offline table of this version's rows (older versions keep theirs, readable)
    storage_id: str  # hash of how the rows are stored online: bytes under another id are never decoded as these
    online_field: str  # the view's name in online keys and fields: name + storage_id


def layout_of(view: FeatureView, version: int = 1) -> ViewLayout:
    storage_id = layout_id(view, version)
    return ViewLayout(version, history_table(view.name, version), storage_id, online_field(view.name, storage_id))
