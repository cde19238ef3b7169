"""Model registry: immutable versions with a model card, and stage aliases.

Layout under ``<data_dir>/models``::

    <name>/<version>/model.pt          weights + architecture
    <name>/<version>/preprocessing.json
    <name>/<version>/card.json         service, definition hashes, dataset manifest hash, metrics, weights hash
    <name>/aliases.json                {"production": 3, "staging": 4}
    <name>/previous.json               each stage's version before its last promotion (rollback)

The SHA-256 of each version's files is also kept in a ledger outside the models folder (the
repo's registry directory, ``models.json``): whoever can write the models folder cannot make a
forged file load, since ``load`` checks every file against the ledger first (and then reads
weights with ``weights_only=True``). ``promote`` loads the version before it moves an alias.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore.errors import FeatureStoreError, NotFoundError
from featurestore.files import atomic_write, file_lock

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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class ModelRegistry:
    def __init__(
        self,
        root: Path,
        ledger: Path,
        announce: Callable[[str, int, str], None] | None = None,
        artifacts: ArtifactStore | None = None,
    ):
        self.root = Path(root)
        self.ledger = Path(ledger)
        self.announce = announce
        self.artifacts = artifacts  # registered files are also kept here, under their hashes

    def _ledger(self) -> dict[str, dict[str, dict[str, str]]]:
        return json.loads(self.ledger.read_text()) if self.ledger.exists() else {}

    @contextlib.contextmanager
    def _locked(self):
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.ledger.with_suffix(".lock")):
            yield

    def verify(self, name: str, version: int) -> None:
        """Raise unless every file of the version is byte for byte what was registered."""
        recorded = self._ledger().get(name, {}).get(str(version))
        if recorded is None:
            raise FeatureStoreError(
                f"model {name} v{version} is not in the registry's ledger ({self.ledger}): "
                "it was not registered here; register it with `featurestore train --register`"
            )
        folder = self.root / name / str(version)
        changed = [f for f in MODEL_FILES if not (folder / f).exists() or _sha256(folder / f) != recorded[f]]
        if changed:
            raise FeatureStoreError(
                f"model {name} v{version}: {changed} differ from the hashes recorded at registration "
                "(modified after registering?); register the model again"
            )

    def register(self, name: str, run_dir: Path) -> int:
        import torch

        check_name(name)
        run_dir = Path(run_dir)
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        params = json.loads((run_dir / "params.json").read_text())
        final = json.loads((run_dir / "final.json").read_text())
        versions = self.versions(name)
        version = (versions[-1] if versions else 0) + 1
        staging = self.root / name / f".v{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        torch.save({"state_dict": state["model"], "config": state["model_config"]}, staging / "model.pt")
        (staging / "preprocessing.json").write_text(json.dumps(state["preprocessor"], indent=2))
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
            "weights_sha256": hashlib.sha256((staging / "model.pt").read_bytes()).hexdigest(),
        }
        (staging / "card.json").write_text(json.dumps(card, indent=2))
        with self._locked():
            ledger = self._ledger()
            ledger.setdefault(name, {})[str(version)] = {f: _sha256(staging / f) for f in MODEL_FILES}
            atomic_write(self.ledger, json.dumps(ledger, indent=1).encode())
        staging.rename(self.root / name / str(version))  # versions appear whole, never partly written
        if self.artifacts is not None:  # a version's files never change: linked, not copied
            for file in MODEL_FILES:
                self.artifacts.put(self.root / name / str(version) / file, link=True)
        return version

    def versions(self, name: str) -> list[int]:
        folder = self.root / check_name(name)
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.exists() else []

    def aliases(self, name: str) -> dict[str, int]:
        file = self.root / name / "aliases.json"
        return json.loads(file.read_text()) if file.exists() else {}

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
        wrong = [f for f in MODEL_FILES if hashlib.sha256(files.get(f, b"")).hexdigest() != hashes.get(f)]
        if wrong:
            raise FeatureStoreError(
                f"model {name} v{version}: {wrong} do not match their hashes (corrupt or partial transfer)"
            )
        staging = self.root / name / f".v{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for file in MODEL_FILES:
            (staging / file).write_bytes(files[file])
        with self._locked():
            ledger = self._ledger()
            ledger.setdefault(name, {})[str(version)] = {f: hashes[f] for f in MODEL_FILES}
            atomic_write(self.ledger, json.dumps(ledger, indent=1).encode())
        staging.rename(self.root / name / str(version))

    def rollback(self, name: str, stage: str = "production") -> int:
        """Point ``stage`` back at the version it had before its last promotion; returns it."""
        previous = self._previous(name).get(stage)
        if previous is None:
            raise FeatureStoreError(f"model {name!r} has no earlier {stage} version to roll back to")
        self.promote(name, previous, stage)
        return previous

    def _previous(self, name: str) -> dict[str, int]:
        file = self.root / name / "previous.json"
        return json.loads(file.read_text()) if file.exists() else {}

    def promote(self, name: str, version: int, stage: str) -> None:
        if stage not in STAGES:
            raise FeatureStoreError(f"stage must be one of {STAGES}, not {stage!r}")
        if version not in self.versions(name):
            raise NotFoundError(f"model {name!r} has no version {version}; versions: {self.versions(name)}")
        try:
            self.load(name, version)  # a version that does not load would break every later restart
        except Exception as exc:
            raise FeatureStoreError(f"model {name} v{version} does not load, so it is not promoted: {exc}") from exc
        before = self.aliases(name)
        if stage in before and before[stage] != version:  # what `rollback` returns to
            atomic_write(
                self.root / name / "previous.json", json.dumps({**self._previous(name), stage: before[stage]}).encode()
            )
        atomic_write(self.root / name / "aliases.json", json.dumps({**before, stage: version}, indent=2).encode())
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
        return json.loads((self.root / name / str(version) / "card.json").read_text())

    def load(self, name: str, ref: str | int = "production", device: str = "cpu") -> LoadedModel:
        """Verify and load a version (``device``: cpu, cuda or auto, as ``featurestore train --device``)."""
        import torch

        from featurestore.training.distributed import pick_device
        from featurestore.training.model import from_saved
        from featurestore.training.preprocessing import Preprocessor

        version = self.resolve(name, ref)
        folder = self.root / name / str(version)
        self.verify(name, version)
        card = self.card(name, version)
        saved = torch.load(folder / "model.pt", weights_only=True)
        cfg = saved["config"]
        model = from_saved(cfg, saved["state_dict"]).to(pick_device(device))
        pre = Preprocessor.from_dict(json.loads((folder / "preprocessing.json").read_text()))
        return LoadedModel(name, version, model, pre, card)


def stale_views(card: dict[str, Any], current_hashes: Mapping[str, str]) -> list[str]:
    """Views whose definitions changed since the model's training data was exported."""
    return sorted(v for v, h in card["definition_hashes"].items() if current_hashes.get(v) != h)
