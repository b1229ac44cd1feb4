"""Algorithms: one readable ``train(recipe, out_dir, *, resume=False, max_steps=None) -> dict`` per module."""
