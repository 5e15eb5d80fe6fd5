"""Trainers built on verl's core ``RayPPOTrainer``: DAPO (``dapo``) and its dynamic sampling logic."""
