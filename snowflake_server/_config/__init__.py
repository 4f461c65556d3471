"""Settings: the options table (flags, environment, file) and the validated settings."""
