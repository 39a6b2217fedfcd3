"""Watching a node: Prometheus metrics, the status page, progress lines (service.py)."""
