"""Entry point of each rank when ``featurestore train --nproc-per-node N`` runs torchrun:
``python -m featurestore.training.launch CONFIG_JSON RUNS_DIR RUN_ID [--resume]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from featurestore.errors import FeatureStoreError
from featurestore.training.trainer import TrainConfig, train


def main(argv: list[str]) -> int:
    config, runs_dir, run_id = TrainConfig(**json.loads(argv[0])), Path(argv[1]), argv[2]
    resume = "--resume" in argv[3:]
    try:
        train(config, runs_dir, resume=run_id if resume else None, run_id=run_id, progress=True)
    except FeatureStoreError as exc:  # one line, not a traceback per rank
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
