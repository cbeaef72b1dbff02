"""Staging: the host arena, copies from the state into it, and the handle of a snapshot."""
