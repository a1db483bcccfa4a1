"""The size of the package's import graph: modules, units, floors, upward imports and import loops.

Usage: ``python .ci/import_graph.py .`` (the repository root; ``patches/`` counts as
``physicsnemo_shardext.patches``). Every ``import`` and ``from ... import`` is an edge,
function-local ones included; ``from pkg import submodule`` goes to the submodule. A
*unit* is a top-level module or a whole subpackage (a wing counts as one); a *floor*
is a unit's height above what it imports (the longest chain down); an *upward import*
closes a loop between units, and the loops are printed. The largest modules close
the report. CONTRIBUTING.md says when to run it (a change that moves modules).
"""

import ast
import collections
import os
import sys

root = sys.argv[1]
mods = {}
for base, pkg in [("physicsnemo_shardext", "physicsnemo_shardext"), ("patches", "physicsnemo_shardext.patches")]:
    for dp, _dn, fn in os.walk(os.path.join(root, base)):
        for f in fn:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), os.path.join(root, base))[:-3].replace(os.sep, ".")
                name = pkg + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))
                mods[name] = os.path.join(dp, f)


def unit(m):
    # a folder counts as one unit (except the top package's own modules)
    parts = m.split(".")
    if len(parts) >= 3 and (m.rsplit(".", 1)[0] in mods or True):
        cand = ".".join(parts[:2])
        if any(k.startswith(cand + ".") for k in mods):
            return cand
    return ".".join(parts[:2]) if len(parts) > 1 else m


edges = collections.defaultdict(set)
for m, path in mods.items():
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                base = m.split(".")[: len(m.split(".")) - node.level + (1 if path.endswith("__init__.py") else 0)]
                mod = ".".join(base + [node.module])
            else:
                mod = node.module
            names = [mod + "." + a.name if (mod + "." + a.name) in mods else mod for a in node.names]
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n != m:
                edges[m].add(n)
units = sorted({unit(m) for m in mods})
uedges = collections.defaultdict(set)
for a, bs in edges.items():
    for b in bs:
        ua, ub = unit(a), unit(b)
        if ua != ub:
            uedges[ua].add(ub)
sys.setrecursionlimit(10000)
idx, low, onst, st, sccs, c = {}, {}, set(), [], [], [0]


def tarjan(v):
    idx[v] = low[v] = c[0]
    c[0] += 1
    st.append(v)
    onst.add(v)
    for w in uedges[v]:
        if w not in idx:
            tarjan(w)
            low[v] = min(low[v], low[w])
        elif w in onst:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop()
            onst.discard(w)
            comp.append(w)
            if w == v:
                break
        sccs.append(comp)


for u in units:
    if u not in idx:
        tarjan(u)
cyc = [sorted(x) for x in sccs if len(x) > 1]
print("cycles (import loops between units):", cyc)
# floors: longest path in unit DAG, counting edges that close cycles as "upward"
order, state, upward = [], {}, []


def visit(u, stack):
    state[u] = 1
    for v in sorted(uedges[u]):
        if state.get(v) == 1:
            upward.append((u, v))
            continue
        if not state.get(v):
            visit(v, stack)
    state[u] = 2
    order.append(u)


for u in units:
    if not state.get(u):
        visit(u, [])
up = set(upward)
floor = {}
for u in order:
    floor[u] = 1 + max([floor[v] for v in uedges[u] if (u, v) not in up and v in floor] or [0])
sizes = sorted(((sum(1 for _ in open(p)), m) for m, p in mods.items()), reverse=True)[:8]
print(f"modules {len(mods)}, units {len(units)}, floors {max(floor.values())}, upward imports {len(up)}: {sorted(up)}")
print("largest:", ", ".join(f"{m.replace('physicsnemo_shardext.', '')} {n}" for n, m in sizes))
