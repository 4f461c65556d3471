"""Never repeating an id across restarts: the state file, the reservation, the worker."""
