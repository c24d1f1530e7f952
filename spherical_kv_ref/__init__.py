"""Spherical KV — NumPy reference (the specification). See docs/format.md and DESIGN."""
