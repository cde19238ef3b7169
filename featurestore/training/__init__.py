"""Training on exported datasets: preprocessing shared with inference, an MLP recipe, runs, model registry."""
