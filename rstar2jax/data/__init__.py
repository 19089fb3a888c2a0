"""Datasets, prompts and synthetic tasks."""
