"""Engines the trainer's workers drive (generation today; see ``generation/``)."""
