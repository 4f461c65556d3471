"""Helpers shared by the tests: fakes (``fakes``), the server in this process
(``inprocess``) or in its own (``processes``), a real ZooKeeper (``zookeeper``),
clients of either (``endpoints``) and the one polling loop (``waiting``)."""
