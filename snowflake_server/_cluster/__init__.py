"""Cluster mode: worker ids leased in ZooKeeper, peer checks, marks in ZooKeeper."""
