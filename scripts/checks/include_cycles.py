#!/usr/bin/env python3
"""Lists the include cycles among the C++/CUDA files of the given folders (the whole source tree
when none are given: every folder of the repository but hidden ones and build trees).

Two kinds of cycle, both printed:
  header cycles: headers that include each other (directly or through other headers), and
  file cycles:   .h/.cc pairs seen as one node ("engine/cpu/attention/attention" = attention.h + attention.cc);
                 a cycle there means two concepts depend on each other (a factory .cc that
                 includes its kinds whose headers include the factory's header, say).

  python3 scripts/checks/include_cycles.py                  # the whole tree (scripts/test.sh)
  python3 scripts/checks/include_cycles.py engine model      # only these folders
Run from the repository root (includes are written from there). Exit status 1 when a cycle exists.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SUFFIXES = (".h", ".cc", ".cu", ".cuh")


def sources(roots):
    for root in roots:
        for d, subdirs, files in os.walk(root):
            # Hidden folders (.git) and build trees (a CMake cache: generated and fetched sources)
            # hold no project sources.
            subdirs[:] = sorted(s for s in subdirs if not s.startswith(".") and
                                not os.path.exists(os.path.join(d, s, "CMakeCache.txt")))
            for f in files:
                if f.endswith(SUFFIXES):
                    yield os.path.normpath(os.path.join(d, f))


def includes(path):
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = INCLUDE.match(line)
            if m:
                out.append(os.path.normpath(m.group(1)))
    return out


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(100000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main():
    roots = sys.argv[1:] or ["."]
    files = sorted(sources(roots))
    headers = {f: [i for i in includes(f) if i.endswith((".h", ".cuh"))] for f in files
               if f.endswith((".h", ".cuh"))}
    concept = lambda p: os.path.splitext(p)[0]
    units = {}
    for f in files:
        deps = units.setdefault(concept(f), set())
        deps.update(concept(i) for i in includes(f) if concept(i) != concept(f))
    found = False
    for title, graph in (("header cycles", headers), ("file (.h/.cc pair) cycles", units)):
        comps = cycles(graph)
        print(f"{title}: {len(comps)}")
        for c in comps:
            print("  " + " <-> ".join(c))
        found |= bool(comps)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
