"""The model: an MLP over standardized numbers and embedded strings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn


class TabularMLP(nn.Module):
    def __init__(
        self,
        numeric_width: int,
        vocab_sizes: list[int],
        hidden: Sequence[int] = (64, 32),
        embedding_dim: int = 8,
        outputs: int = 1,
    ):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(size, embedding_dim) for size in vocab_sizes)
        layers: list[nn.Module] = []
        width = numeric_width + embedding_dim * len(vocab_sizes)
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, outputs))
        self.mlp = nn.Sequential(*layers)
        self.config = {
            "numeric_width": numeric_width,
            "vocab_sizes": list(vocab_sizes),
            "hidden": list(hidden),
            "embedding_dim": embedding_dim,
            "outputs": outputs,
        }

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        parts = [x_num] + [emb(x_cat[:, i]) for i, emb in enumerate(self.embeddings)]
        return self.mlp(torch.cat(parts, dim=1)).squeeze(-1)


def saved_weights(state_dict: Mapping[str, torch.Tensor], config: dict) -> dict:
    """What a registered version's ``model.pt`` holds: the model config, and each tensor on a
    storage of exactly its own bytes. ``torch.save`` writes whole storages, and a tensor gathered
    from FSDP shards sits on a padded one: a version broadcast as tensors is rebuilt to the same
    bytes, and so the same hashes, only if neither side writes padding."""
    return {
        "state_dict": {k: t.detach().clone(memory_format=torch.contiguous_format) for k, t in state_dict.items()},
        "config": config,
    }


def from_saved(config: dict, state_dict: dict) -> TabularMLP:
    """A model rebuilt from its config and weights, ready to score. Built on the meta device and
    given the saved tensors as they are: no random initialisation of tables that are overwritten
    anyway (seconds for a 100 MB embedding)."""
    with torch.device("meta"):
        model = TabularMLP(
            config["numeric_width"], config["vocab_sizes"], config["hidden"], config["embedding_dim"], config["outputs"]
        )
    model.load_state_dict(state_dict, assign=True)
    return model.eval()


def score(model: TabularMLP, x_num: torch.Tensor, x_cat: torch.Tensor, task: str) -> torch.Tensor:
    """Scores as served: probabilities for classification, values for regression (float32)."""
    with torch.inference_mode():
        out = model(x_num, x_cat)
        return torch.sigmoid(out) if task == "classification" else out
