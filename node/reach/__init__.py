"""Reachability: is this node reachable from the internet, and can its gateway make it so."""
