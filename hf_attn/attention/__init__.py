"""Attention functions following the transformers attention contract (see `grouped.py`)."""
