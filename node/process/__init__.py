"""The node as an operating-system process: one node per state directory (state_lock.py),
the trainer's lower CPU priority (priority.py), allocator tuning for large tensors
(memory.py) and torch imported in the background while the node starts (preload.py)."""
