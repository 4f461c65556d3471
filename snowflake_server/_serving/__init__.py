"""The serving core: listeners, admission, fairness by work, deadlines, TLS and drain,
for every protocol."""
