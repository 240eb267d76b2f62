"""Recipes: the typed configuration (frozen dataclasses, unknown keys named), its defaults, and the bundled files."""
