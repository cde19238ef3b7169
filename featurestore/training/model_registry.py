"""Model registry: immutable versions with a model card, and stage aliases.

Layout under ``<data_dir>/models`` (a folder or an ``s3://`` prefix)::

    <name>/<version>/model.pt          weights + architecture
    <name>/<version>/preprocessing.json
    <name>/<version>/card.json         service, definition hashes, dataset manifest hash, metrics, weights hash
    <name>/aliases.json                {"production": 3, "staging": 4, "previous": {"production": 2}}

The SHA-256 of each version's files is also kept in a ledger outside the models folder (the
repo's registry directory, ``models.json``): whoever can write the models folder cannot make a
forged file load, since ``load`` checks every file against the ledger first (and then reads
weights with ``weights_only=True``). ``promote`` loads the version before it moves an alias.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore.errors import FeatureStoreError, NotFoundError
from featurestore.storage import LocalObjects, Location, update

if TYPE_CHECKING:  # torch is imported where weights are read or written: listing, cards and lineage work without it
    from featurestore.tracking.artifacts import ArtifactStore
    from featurestore.training.model import TabularMLP
    from featurestore.training.preprocessing import Preprocessor

STAGES = ("staging", "production")


MODELS_CHANNEL = b"models"  # promotions are published here (see FeatureStore.model_registry)


@dataclass
class LoadedModel:
    name: str
    version: int
    model: TabularMLP
    preprocessor: Preprocessor
    card: dict[str, Any]

    @property
    def inputs(self) -> list[str]:
        return self.preprocessor.inputs

    def predict(self, columns: Mapping[str, Any]) -> np.ndarray:
        """float32 scores for columns of feature values (Arrow arrays or lists), nulls allowed."""
        from featurestore.training.model import score

        x_num, x_cat = self.preprocessor.transform(columns)
        device = next(self.model.parameters()).device
        return score(self.model, x_num.to(device), x_cat.to(device), self.card["task"]).cpu().numpy().astype(np.float32)


MODEL_FILES = ("model.pt", "preprocessing.json", "card.json")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"  # a model's name is a folder: no separators, no '..'


def check_name(name: str) -> str:
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name) or ".." in name:
        raise FeatureStoreError(
            f"{name!r} is not a model name: letters, digits, '_', '.' and '-', starting with a letter or digit"
        )
    return name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


Ledger = dict[str, dict[str, dict[str, str]]]  # model -> version -> file -> SHA-256


class ModelRegistry:
    """Models under ``root`` (a folder or ``s3://`` prefix), their hashes in the ``ledger`` object.

    Every shared object changes by compare-and-swap (``storage.update``), so registrations and
    promotions from several machines neither lose one another nor take the same version number."""

    def __init__(
        self,
        root: Path | Location,
        ledger: Path | Location,
        announce: Callable[[str, int, str], None] | None = None,
        artifacts: ArtifactStore | None = None,
    ):
        where, ledger_at = Location.of(root), Location.of(ledger)
        self.root: Path | Location = where.path if where.is_local else where  # a folder, where there is one
        self.ledger: Path | Location = ledger_at.path if ledger_at.is_local else ledger_at
        self.models = where.objects()
        folder, self._ledger_key = ledger_at.split()
        self._ledger_objects = folder.objects()
        self.announce = announce
        self.artifacts = artifacts  # registered files are also kept here, under their hashes

    def _ledger(self) -> Ledger:
        found = self._ledger_objects.get(self._ledger_key)
        return json.loads(found[0]) if found is not None else {}

    def _record(self, add: Callable[[Ledger], Ledger | None]) -> None:
        """Change the ledger by compare-and-swap: ``add`` gets the current ledger, returns the new one."""

        def change(current: bytes | None) -> bytes | None:
            changed = add(json.loads(current) if current else {})
            return None if changed is None else json.dumps(changed, indent=1).encode()

        update(self._ledger_objects, self._ledger_key, change)

    def verify(self, name: str, version: int) -> dict[str, bytes]:
        """Every file of the version, checked byte for byte against what was registered."""
        recorded = self._ledger().get(name, {}).get(str(version))
        if recorded is None:
            raise FeatureStoreError(
                f"model {name} v{version} is not in the registry's ledger ({self.ledger}): "
                "it was not registered here; register it with `featurestore train --register`"
            )
        files = {f: self.models.get(f"{name}/{version}/{f}") for f in MODEL_FILES}
        changed = [f for f, found in files.items() if found is None or _sha256(found[0]) != recorded[f]]
        if changed:
            raise FeatureStoreError(
                f"model {name} v{version}: {changed} differ from the hashes recorded at registration "
                "(modified after registering?); register the model again"
            )
        return {f: found[0] for f, found in files.items() if found is not None}

    def register(self, name: str, run_dir: Path) -> int:
        import torch

        from featurestore.training.model import saved_weights

        check_name(name)
        run_dir = Path(run_dir)
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        params = json.loads((run_dir / "params.json").read_text())
        final = json.loads((run_dir / "final.json").read_text())
        weights = io.BytesIO()
        torch.save(saved_weights(state["model"], state["model_config"]), weights)
        files = {
            "model.pt": weights.getvalue(),
            "preprocessing.json": json.dumps(state["preprocessor"], indent=2).encode(),
        }

        def claim(ledger: Ledger) -> Ledger:
            # the next number after every version recorded or present: a crashed registration's
            # number is skipped, never reused over its files
            taken = [int(v) for v in ledger.get(name, {})] + self.versions(name)
            version = max(taken, default=0) + 1
            card = {
                "name": name,
                "version": version,
                "task": params["config"]["task"],
                "feature_service": params["feature_service"],
                "features": params["features"],
                "request_inputs": params["config"]["request_inputs"],
                "definition_hashes": params["definition_hashes"],
                "dataset_manifest_hash": params["dataset_manifest_hash"],
                "metrics": final,
                "run": run_dir.name,
                "code_version": params["code_version"],
                "registered_at": datetime.now(UTC).isoformat(),
                "training_layout": params.get("layout"),  # world size, shard and sync groups, device
                "weights_sha256": _sha256(files["model.pt"]),
            }
            files["card.json"] = json.dumps(card, indent=2).encode()
            claimed.append(version)
            ledger.setdefault(name, {})[str(version)] = {f: _sha256(files[f]) for f in MODEL_FILES}
            return ledger

        claimed: list[int] = []
        self._record(claim)
        version = claimed[-1]
        self._write(name, version, files)
        if self.artifacts is not None:
            for file in MODEL_FILES:
                if isinstance(self.models, LocalObjects):  # a version's files never change: linked, not copied
                    self.artifacts.put(self.models.root / name / str(version) / file, link=True)
                else:
                    self.artifacts.put_bytes(files[file])
        return version

    def _write(self, name: str, version: int, files: Mapping[str, bytes]) -> None:
        """A version's files; its card last, since a version is listed once its card is there."""
        for file in sorted(MODEL_FILES, key=lambda f: f == "card.json"):
            self.models.put(f"{name}/{version}/{file}", files[file])

    def versions(self, name: str) -> list[int]:
        prefix = f"{check_name(name)}/"
        found = {k[len(prefix) :].split("/")[0] for k in self.models.keys(prefix) if k.endswith("/card.json")}
        return sorted(int(v) for v in found if v.isdigit())

    def names(self) -> list[str]:
        return sorted({k.split("/")[0] for k in self.models.keys("") if k.endswith("/card.json")})

    def _stages(self, name: str) -> tuple[dict[str, Any], str | None]:
        found = self.models.get(f"{check_name(name)}/aliases.json")
        return (json.loads(found[0]), found[1]) if found is not None else ({}, None)

    def aliases(self, name: str) -> dict[str, int]:
        return {stage: v for stage, v in self._stages(name)[0].items() if stage in STAGES}

    def hashes(self, name: str) -> dict[int, dict[str, str]]:
        """Every registered version's file hashes, from the ledger."""
        return {int(v): files for v, files in self._ledger().get(name, {}).items()}

    def install(self, name: str, version: int, files: dict[str, bytes], hashes: dict[str, str]) -> None:
        """Add a version made elsewhere (copied by the checkpoint engine), under its own number,
        after checking every file against ``hashes``; a version already here is left as is."""
        check_name(name)
        if type(version) is not int or version < 1:
            raise FeatureStoreError(f"model {name}: {version!r} is not a version number")
        if version in self.versions(name):
            return
        wrong = [f for f in MODEL_FILES if _sha256(files.get(f, b"")) != hashes.get(f)]
        if wrong:
            raise FeatureStoreError(
                f"model {name} v{version}: {wrong} do not match their hashes (corrupt or partial transfer)"
            )

        def add(ledger: Ledger) -> Ledger:
            ledger.setdefault(name, {})[str(version)] = {f: hashes[f] for f in MODEL_FILES}
            return ledger

        self._record(add)
        self._write(name, version, files)

    def rollback(self, name: str, stage: str = "production") -> int:
        """Point ``stage`` back at the version it had before its last promotion; returns it."""
        previous = self._stages(name)[0].get("previous", {}).get(stage)
        if previous is None and (legacy := self.models.get(f"{name}/previous.json")) is not None:
            previous = json.loads(legacy[0]).get(stage)  # written by releases before aliases held it
        if previous is None:
            raise FeatureStoreError(f"model {name!r} has no earlier {stage} version to roll back to")
        self.promote(name, previous, stage)
        return previous

    def promote(self, name: str, version: int, stage: str, *, loads: bool = False) -> None:
        """Point ``stage`` at ``version`` once it loads (``loads``: the caller has it loaded already)."""
        if stage not in STAGES:
            raise FeatureStoreError(f"stage must be one of {STAGES}, not {stage!r}")
        if version not in self.versions(name):
            raise NotFoundError(f"model {name!r} has no version {version}; versions: {self.versions(name)}")
        try:
            if not loads:
                self.load(name, version)  # a version that does not load would break every later restart
        except Exception as exc:
            raise FeatureStoreError(f"model {name} v{version} does not load, so it is not promoted: {exc}") from exc

        def move(current: bytes | None) -> bytes:
            # the aliases and each stage's version before its last promotion (what `rollback`
            # returns to) are one object, so concurrent promotions keep both consistent
            stages = json.loads(current) if current else {}
            before = stages.get(stage)
            if before is not None and before != version:
                stages["previous"] = {**stages.get("previous", {}), stage: before}
            stages[stage] = version
            return json.dumps(stages, indent=2).encode()

        update(self.models, f"{name}/aliases.json", move)
        if self.announce:
            self.announce(name, version, stage)

    def resolve(self, name: str, ref: str | int) -> int:
        if isinstance(ref, int) or str(ref).isdigit():
            version = int(ref)
        else:
            version = self.aliases(name).get(str(ref))  # type: ignore[assignment]
            if version is None:
                raise NotFoundError(
                    f"model {name!r} has no {ref!r} version; promote one with `featurestore models promote`"
                )
        if version not in self.versions(name):
            raise NotFoundError(f"model {name!r} has no version {version}")
        return version

    def card(self, name: str, version: int) -> dict[str, Any]:
        found = self.models.get(f"{check_name(name)}/{version}/card.json")
        if found is None:
            raise NotFoundError(f"model {name!r} has no version {version}")
        return json.loads(found[0])

    def file(self, name: str, version: int, file: str) -> bytes:
        """One file of a version, checked against the ledger."""
        return self.verify(check_name(name), version)[file]

    def load(self, name: str, ref: str | int = "production", device: str = "cpu") -> LoadedModel:
        """Verify and load a version (``device``: cpu, cuda or auto, as ``featurestore train --device``)."""
        import torch

        from featurestore.training.distributed import pick_device
        from featurestore.training.model import from_saved
        from featurestore.training.preprocessing import Preprocessor

        version = self.resolve(name, ref)
        files = self.verify(name, version)
        card = json.loads(files["card.json"])
        saved = torch.load(io.BytesIO(files["model.pt"]), weights_only=True)
        cfg = saved["config"]
        model = from_saved(cfg, saved["state_dict"]).to(pick_device(device))
        pre = Preprocessor.from_dict(json.loads(files["preprocessing.json"]))
        return LoadedModel(name, version, model, pre, card)


def stale_views(card: dict[str, Any], current_hashes: Mapping[str, str]) -> list[str]:
    """Views whose definitions changed since the model's training data was exported."""
    return sorted(v for v, h in card["definition_hashes"].items() if current_hashes.get(v) != h)
