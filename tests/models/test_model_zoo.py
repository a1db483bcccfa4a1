"""PhysicsNeMo's model families (``examples/model_zoo.py``) sharded against single-process.

Each model of the zoo runs unmodified on ShardTensor inputs and is compared with
`check_conformance`: the output, every input gradient and every parameter
gradient, after `redraw_zero_parameters` (zero-initialised output layers such as
SongUNet's attention projection or DiT's adaLN-zero would hide a wrong forward)
and with dropout/drop-path set to 0 (random masks cannot match single-process).
Cells: an uneven split on 2 ranks, an even split on 2 ranks and, for 2-D fields,
a 2x2 mesh splitting two dims. A model the zoo records as refused must raise
``MissingShardPatch`` naming the op; none may mismatch silently. Long cells are
marked ``slow`` (``--run-slow``); CI runs every model's uneven cell that is not
slow and a representative set of even and 2x2 cells. ``docs/models.md`` has the
table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from physicsnemo_shardext import MissingShardPatch
from physicsnemo_shardext.testing import (
    ShardSpec,
    check_conformance,
    chunk_split_sizes,
    redraw_zero_parameters,
    without_random_masks,
)

_PATH = Path(__file__).resolve().parents[2] / "examples" / "model_zoo.py"


def _load_zoo():
    if "model_zoo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("model_zoo", _PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_zoo"] = module
        spec.loader.exec_module(module)
    return sys.modules["model_zoo"]


zoo = _load_zoo()
MATCHING = [name for name, entry in zoo.ZOO.items() if entry.outcome == "match"]
REFUSED = [name for name, entry in zoo.ZOO.items() if entry.outcome == "refused"]
#: Even and 2x2 cells run in CI for these (one per kind of layer mix); the rest with --run-slow.
EVEN_IN_CI = {"songunet", "dit", "fno2d", "pangu"}
MESH_IN_CI = {"songunet", "pix2pix"}


def _cells(names, in_ci=None, needs_2d=False):
    cells = []
    for name in names:
        entry = zoo.ZOO[name]
        if needs_2d and entry.split_2d is None:
            continue
        slow = entry.slow or (in_ci is not None and name not in in_ci)
        cells.append(pytest.param(name, marks=(pytest.mark.slow,) if slow else (), id=name))
    return cells


def _run(name: str, mesh, sizes, two_d: bool = False):
    entry = zoo.ZOO[name]
    model, inputs = entry.build()
    without_random_masks(model)
    redraw_zero_parameters(model)
    specs = entry.specs(mesh, inputs, two_d)
    if sizes is not None:
        specs = [ShardSpec(s.mesh, s.placements, list(sizes)) if s is not None else None for s in specs]
    expected = entry.placements_2d if two_d else entry.expected_placements
    if expected == "input" and two_d and entry.expected_placements != "input":
        expected = entry.expected_placements
    return check_conformance(
        model,
        inputs,
        specs,
        rtol=entry.rtol,
        atol=entry.atol,
        kwargs=entry.kwargs,
        params=entry.params,
        expected_placements=expected,
    )


def _compared_every_gradient(name: str, report) -> None:
    """Parameter gradients were compared (a gradient missing on one side is a mismatch in the report itself;
    parameters that take no gradient in either run, e.g. One2ManyRNN's unused decoder level, are skipped)."""
    compared = [k for k in report.max_abs_errors if k.startswith("gradient of parameter")]
    assert compared, f"{name}: no parameter gradient was compared"


@pytest.mark.multirank(2, timeout=300)
@pytest.mark.parametrize("name", _cells(MATCHING))
def test_zoo_model_matches_on_an_uneven_split(domain_mesh, name):
    report = _run(name, domain_mesh, None)
    _compared_every_gradient(name, report)


@pytest.mark.multirank(2, timeout=300)
@pytest.mark.parametrize("name", _cells(MATCHING, EVEN_IN_CI))
def test_zoo_model_matches_on_an_even_split(domain_mesh, name):
    entry = zoo.ZOO[name]
    model, inputs = entry.build()
    total = inputs[entry.sharded[0]].shape[entry.dims[0]]
    _compared_every_gradient(name, _run(name, domain_mesh, chunk_split_sizes(total, 2)))


@pytest.mark.multirank(4, timeout=300)
@pytest.mark.parametrize("name", _cells(MATCHING, MESH_IN_CI, needs_2d=True))
def test_zoo_model_matches_on_a_2x2_mesh(spatial_mesh, name):
    refused = zoo.ZOO[name].refused_2d
    if refused:
        with pytest.raises(MissingShardPatch, match=refused.split(":")[0].replace(".", r"\.")):
            _run(name, spatial_mesh, None, two_d=True)
        return
    _compared_every_gradient(name, _run(name, spatial_mesh, None, two_d=True))


@pytest.mark.multirank(2, timeout=300)
@pytest.mark.parametrize("name", _cells(REFUSED))
def test_zoo_model_refused_names_the_op(domain_mesh, name):
    op = zoo.ZOO[name].note.split(":")[0]
    with pytest.raises(MissingShardPatch, match=op.replace(".", r"\.")):
        _run(name, domain_mesh, None)


def test_every_zoo_entry_says_what_to_expect():
    for name, entry in zoo.ZOO.items():
        assert entry.outcome in ("match", "refused", "not domain-parallel"), name
        if entry.outcome != "match":
            assert entry.note, f"{name}: a refused or not domain-parallel model needs its reason"
        if entry.outcome == "match":
            assert entry.dims and len(entry.split) == 2, f"{name}: a 2-rank split of the sharded dim"


def test_zoo_covers_the_model_families_of_physicsnemo():
    import physicsnemo.models as models

    families = {
        path.name for path in Path(models.__file__).parent.iterdir() if path.is_dir() and not path.name.startswith("_")
    }
    covered = {entry.family for entry in zoo.ZOO.values()}
    # Graph and mesh models take no field or sequence to split (graphs are partitioned otherwise).
    graph_models = {"graphcast", "meshgraphnet", "mesh_reduced", "vfgn", "mlp"}
    assert families - graph_models <= covered, sorted(families - graph_models - covered)
