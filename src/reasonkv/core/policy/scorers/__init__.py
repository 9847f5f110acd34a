"""Scorers: which tokens to keep (higher score = keep). One paper per module."""
