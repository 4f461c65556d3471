"""Putting it together: the composition root, the process entry point, the supervisor."""
