"""Attention backends: each prepares a step's shared metadata once and runs every layer's paged attention."""
