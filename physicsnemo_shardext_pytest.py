"""pytest entry point of physicsnemo-shardext (``pytest11: shardext``), light until a test needs it.

Installing physicsnemo-shardext puts this module into every pytest run of the
environment, including projects that never use it. So it imports pytest and the
standard library only: it declares the ini values, the ``multirank`` marker and
the multirank fixtures, and names `SplitCase` test ids. The implementation,
`physicsnemo_shardext.testing.pytest_plugin` (which imports the package, hence
torch and PhysicsNeMo, and installs the patches), is imported and registered
as a plugin of the session only when a collected test is marked ``multirank``
or requests one of the fixtures (`FIXTURES`), right after collection and before
any test runs. A fixture requested through ``request.getfixturevalue`` loads it
on first use. ``-p no:shardext`` switches off both.

Examples:
    Which tests load the implementation:

    >>> from physicsnemo_shardext_pytest import needs_implementation
    >>> needs_implementation(["tmp_path", "monkeypatch"], marked=False)
    False
    >>> needs_implementation(["request", "rank"], marked=False)
    True
    >>> needs_implementation([], marked=True)
    True
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import pytest

__all__ = ["FIXTURES", "IMPLEMENTATION", "MARKER", "implementation", "needs_implementation"]

#: The module holding the hooks and fixture bodies (imports torch and PhysicsNeMo).
IMPLEMENTATION = "physicsnemo_shardext.testing.pytest_plugin"
#: The marker that runs a test body on N ranks.
MARKER = "multirank"
#: The fixtures declared here, whose values the implementation creates.
FIXTURES = frozenset({"domain_mesh", "ddp_domain_mesh", "spatial_mesh", "rank", "world_size", "registry_sandbox"})


def needs_implementation(fixturenames: Iterable[str], marked: bool) -> bool:
    """Whether a test marked ``multirank`` (``marked``) or using ``fixturenames`` needs the implementation."""
    return marked or not FIXTURES.isdisjoint(fixturenames)


def implementation(config: pytest.Config) -> ModuleType:
    """The implementation module, imported and registered as a plugin of ``config``'s session once.

    Registered late, it still gets ``pytest_configure`` (a historic hook) and every
    later hook call: ``pytest_runtest_setup``, ``pytest_pyfunc_call``, ``pytest_unconfigure``.
    """
    module = importlib.import_module(IMPLEMENTATION)
    if not config.pluginmanager.is_registered(module):
        config.pluginmanager.register(module, IMPLEMENTATION)
    return module


def _registered(config: pytest.Config) -> bool:
    module = sys.modules.get(IMPLEMENTATION)
    return module is not None and config.pluginmanager.is_registered(module)


# -- hooks ------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("shardext_timeout", "default timeout (s) of a multirank test (120)", default="")
    parser.addini("shardext_grace", "seconds the other ranks get after one rank failed or died (10)", default="")
    parser.addini("shardext_startup_timeout", "seconds a worker pool may take to start (300)", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(n, timeout=None, seed=None): run the test body on n ranks "
        "(spawned gloo/NCCL workers, or inline under torchrun with WORLD_SIZE == n).",
    )


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    """Test ids for `SplitCase` values: ``uneven-6-11`` rather than ``sizes0``."""
    # A SplitCase value means its module is imported already: nothing is imported here.
    splits = sys.modules.get("physicsnemo_shardext.testing.splits")
    if splits is not None and isinstance(val, splits.SplitCase):
        return str(val.id)
    return None


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: only tests that will run count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(
        needs_implementation(getattr(item, "fixturenames", ()), item.get_closest_marker(MARKER) is not None)
        for item in items
    ):
        implementation(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Only for a marked test that did not pass through collection above: the
    # implementation registered now misses this very hook call, so it is called here.
    if item.get_closest_marker(MARKER) is not None and not _registered(item.config):
        implementation(item.config).pytest_runtest_setup(item)


# -- fixtures (bodies in the implementation) ----------------------------------------------
def _value(request: pytest.FixtureRequest, kind: str) -> Any:
    return implementation(request.config).fixture_value(request, kind)


@pytest.fixture
def domain_mesh(request: pytest.FixtureRequest) -> Any:
    """1-D ``DeviceMesh`` over all ranks, dim name ``"domain"``."""
    return _value(request, "domain_mesh")


@pytest.fixture
def ddp_domain_mesh(request: pytest.FixtureRequest) -> Any:
    """2-D ``DeviceMesh`` ``(2, N/2)`` named ``("ddp", "domain")`` (2x2 with 4 ranks; even N >= 4)."""
    return _value(request, "ddp_domain_mesh")


@pytest.fixture
def spatial_mesh(request: pytest.FixtureRequest) -> Any:
    """2-D ``DeviceMesh`` ``(2, N/2)`` named ``("h", "w")`` for ``[Shard(H), Shard(W)]``, any even N.

    On 2 ranks it is ``(2, 1)``: H split in two, W whole on each rank (one split size
    for mesh dim 1, e.g. ``{0: [3, 5], 1: [6]}``), still a 2-D mesh, so 2-D code paths
    run under ``torchrun --nproc-per-node 2`` as well.
    """
    return _value(request, "spatial_mesh")


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Any:
    """This rank's global rank (``torch.distributed.get_rank()``)."""
    return _value(request, "rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> Any:
    """The number of ranks."""
    return _value(request, "world_size")


@pytest.fixture
def registry_sandbox(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Registries restored after the test; yields the plugin registry (or a snapshot).

    Multirank bodies are always sandboxed; this fixture makes it explicit and gives
    single-process tests the same isolation.
    """
    yield from implementation(request.config).registry_sandbox_values(request)
