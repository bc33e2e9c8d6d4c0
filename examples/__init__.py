"""Runnable examples: a Hydra app (train.py), a drop-in script (drop_in.py), and their models and data."""
