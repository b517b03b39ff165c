"""gpo: group-based policy optimisation for language models, on PyTorch Lightning."""
