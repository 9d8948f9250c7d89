"""Models in plain PyTorch: the unsharded references that parallel plans transform."""
