"""Making ids: the pure generator and the clocks it is given."""
