"""No test reaches into a private member: tests drive the product through what a caller
could use (a public method or property, or a clock, sleep, pool or store injected
where it is made), so that the product's insides can change under them.

Every file under tests/ (its helpers in tests/support too) is read with ``ast``: an
attribute named ``_x`` of anything but ``self``, ``cls`` or ``super()``, and a
``setattr``/``getattr``/``delattr`` (``monkeypatch.setattr`` included) of such a
name, is a poke. Importing a private *module* (``snowflake_server._cluster.gate``) is
not: the package's modules are private by name. The few pokes left drive kazoo the
way kazoo's own tests do; each is listed below with its reason.
"""

from __future__ import annotations

import ast

from tests.docs.render import ROOT

TESTS = ROOT / "tests"

ALLOWED: dict[tuple[str, str], str] = {
    ("tests/support/forking.py", "_exit"): (
        "os._exit in a forked child: the documented way to leave a fork without running the "
        "parent's atexit handlers and pytest's teardown twice"
    ),
    ("tests/server/test_membership.py", "_call"): (
        "expires the session (or drops the connection) as kazoo's own test harness does: "
        "a real session event, no public route in kazoo"
    ),
    ("tests/server/test_zk_tls.py", "_call"): (
        "drops the connection as kazoo's own test harness does, so that the client "
        "reconnects (with the rotated certificate files) in the same session"
    ),
    ("tests/server/test_zkmarks.py", "_call"): (
        "expires the session as kazoo's own test harness does"
    ),
    ("tests/server/test_session.py", "_connection"): (
        "the product watches kazoo's handshake on KazooClient._connection._invoke; the test "
        "hands it a connection that answers a handshake as an expired session does"
    ),
    ("tests/server/test_session.py", "_invoke"): "the handshake kazoo makes, as above",
}
"""(file, attribute): why it cannot be a public route."""

_REFLECTION = {"setattr", "getattr", "delattr"}


def pokes(source: str) -> list[tuple[int, str]]:
    """The private members ``source`` touches: (line, name)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            what, target = node.args[1], node.args[0]
            if (
                name in _REFLECTION
                and isinstance(what, ast.Constant)
                and isinstance(what.value, str)
                and _private(what.value)
                and not _own(target)
            ):
                found.append((node.lineno, what.value))
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: a class's own members."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def test_the_checker_finds_a_poke_and_leaves_a_class_its_own() -> None:
    source = (
        "class A(B):\n"
        "    def f(self) -> None:\n"
        "        self._x = super()._y()\n"
        "        cls._z\n"
        "def g(a, monkeypatch):\n"
        "    a._secret\n"
        "    a.b._c()\n"
        "    monkeypatch.setattr(a, '_d', 1)\n"
        "    getattr(a, '__dict__')\n"
        "    import snowflake_server._cluster.gate\n"
    )
    assert pokes(source) == [(6, "_secret"), (7, "_c"), (8, "_d")]


def test_no_test_touches_a_private_member() -> None:
    found: list[str] = []
    used: set[tuple[str, str]] = set()
    for path in sorted(TESTS.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for line, attribute in pokes(path.read_text()):
            if (name, attribute) in ALLOWED:
                used.add((name, attribute))
            else:
                found.append(f"{name}:{line}: .{attribute}")
    assert not found, "private members touched (give the product a seam):\n" + "\n".join(found)
    assert used == set(ALLOWED), f"allowed but no longer needed: {set(ALLOWED) - used}"


def test_every_allowed_poke_says_why() -> None:
    for (path, attribute), why in ALLOWED.items():
        assert (ROOT / path).is_file(), path
        assert _private(attribute) and len(why) > 20, (path, attribute)
