#!/usr/bin/env python3
"""The import graph of the library (src/, not src/bin/), checked against the
architecture. Fails (exit 1), naming the file, line and import, on

  - a cycle between modules (a parent declaring or re-exporting its own
    children, and a child using its ancestors, are not edges: that is how a
    Rust module and its files fit together), and
  - an import from one folder of src/ into another that the table "What each
    folder owns" of docs/ARCHITECTURE.md does not allow in its column
    "depends on" (the doc is the one list: a new edge is a change to it), or
    a folder the table has no row for. The table lists the layers from the
    bottom up, so a row naming a later row fails too.

Every path of the library is read: `use` trees, grouped ones included
(`use crate::{a::x, b::{y, z}}`), paths written inline (`crate::a::f()`,
`super::super::b::T`, `$crate::...` in macros), and paths through a name a
`use` brought in (`use crate::backend::cpu; cpu::bf16::detect()`). Comments
and string literals are not read.

  python3 scripts/check_deps.py        # the check
  python3 scripts/check_deps.py -v     # and the folder edges found

Python 3 standard library only.
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
SRC = os.path.join(ROOT, 'src')
DOC = os.path.join(ROOT, 'docs', 'ARCHITECTURE.md')
TABLE = 'What each folder owns'
COLUMN = 'depends on'


def strip_code(text):
    """`text` with comments and the insides of string and char literals
    blanked out (newlines kept, so line numbers hold)."""
    out, i, n = [], 0, len(text)

    def blank(s):
        return re.sub(r'[^\n]', ' ', s)

    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith('/*', i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith('/*', j):
                    depth, j = depth + 1, j + 2
                elif text.startswith('*/', j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif re.match(r'b?r#*"', text[i:i + 260]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == '_')):
            m = re.match(r'b?r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(m.group(0) + blank(text[i + m.end():j - len(end)]) + end)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == '\\' else 1
            out.append('"' + blank(text[i + 1:j]) + '"')
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}'), else a lifetime or label.
            m = re.match(r"'(\\(u\{[0-9a-fA-F]*\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'", text[i:])
            if m:
                out.append("'" + ' ' * (m.end() - 2) + "'")
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def modules():
    """Module path (`backend::cpu::gemm`, '' for lib.rs) -> (file, code)."""
    mods = {}
    for root, dirs, files in os.walk(SRC):
        dirs.sort()
        if os.path.relpath(root, SRC).split(os.sep)[0] == 'bin':
            continue
        for f in sorted(files):
            if not f.endswith('.rs'):
                continue
            p = os.path.join(root, f)
            rel = os.path.relpath(p, SRC)[:-3].replace(os.sep, '::')
            mod = '' if rel in ('lib', 'main') else re.sub(r'(^|::)mod$', '', rel)
            with open(p, encoding='utf-8') as fh:
                mods[mod] = (os.path.relpath(p, ROOT), strip_code(fh.read()))
    return mods


def expand_tree(tree):
    """The paths of a use tree, each with the name it binds (None for a glob):
    `a::{b, c::{d as e, self}, f::*}` -> (a::b, b), (a::c::d, e), (a::c, c), (a::f, None)."""
    toks = re.findall(r'\$?\w+|::|[{},*]', tree)
    out, i = [], 0

    def parse(prefix):
        nonlocal i
        path = list(prefix)
        while i < len(toks):
            t = toks[i]
            if t == '::':
                i += 1
            elif t == '{':
                i += 1
                while i < len(toks) and toks[i] != '}':
                    if toks[i] == ',':
                        i += 1
                        continue
                    parse(path)
                i += 1  # '}'
                return
            elif t == '*':
                i += 1
                out.append((path, None))
                return
            elif t in (',', '}'):
                break
            elif t == 'as':
                name = toks[i + 1]
                i += 2
                out.append((path, None if name == '_' else name))
                return
            else:
                path = path + [t]
                i += 1
        if path and path[-1] == 'self':
            path = path[:-1]
        if path:
            out.append((path, path[-1]))

    parse([])
    return out


USE = re.compile(r'\buse\s+([^;]*);')
INLINE = re.compile(r'(?<![\w:])(\$crate|crate|super|self)((?:\s*::\s*\w+)+)')
VIS_IN = re.compile(r'\bpub\s*\(\s*in\s+[^)]*\)')


def resolve(path, cur, mods):
    """The module a path (list of segments) names or reaches into, from module
    `cur`; None for a path outside the crate."""
    parts = list(path)
    if parts[0] in ('crate', '$crate'):
        base, parts = [], parts[1:]
    elif parts[0] == 'super':
        base = cur.split('::') if cur else []
        while parts and parts[0] == 'super':
            base, parts = base[:-1], parts[1:]
    elif parts[0] == 'self':
        base, parts = (cur.split('::') if cur else []), parts[1:]
    else:
        return None
    full = base + parts
    for k in range(len(full), -1, -1):
        m = '::'.join(full[:k])
        if m in mods:
            return m
    return None


def inline_modules(code):
    """The `mod name { ... }` blocks of a file: (start, end, name)."""
    spans = []
    for x in re.finditer(r'\bmod\s+(\w+)\s*\{', code):
        depth, j = 0, x.end() - 1
        while j < len(code):
            if code[j] == '{':
                depth += 1
            elif code[j] == '}':
                depth -= 1
                if depth == 0:
                    break
            j += 1
        spans.append((x.start(), j, x.group(1)))
    return spans


def scope_at(module, spans, pos):
    """The module path at `pos` of a file whose module is `module`: inside
    `mod amx { ... }` of `gemm::bf16`, `super` is `gemm::bf16`."""
    inner = [name for a, b, name in spans if a < pos < b]
    return '::'.join(([module] if module else []) + inner)


def line_of(code, pos):
    return code.count('\n', 0, pos) + 1


def graph(mods):
    """Module -> {module it imports: (file, line, the import as written)}."""
    edges = {m: {} for m in mods}
    for m, (path, code) in mods.items():
        code = VIS_IN.sub(lambda x: ' ' * len(x.group(0)), code)
        found = []  # (position, path segments, the text to show)
        aliases = {}  # a name a `use` bound to a module of the crate -> that module
        uses = []  # spans of `use` items, whose paths are read from their trees
        spans = inline_modules(code)
        for u in USE.finditer(code):
            uses.append((u.start(), u.end()))
            text = 'use ' + re.sub(r'\s+', ' ', u.group(1)).strip() + ';'
            for segs, bound in expand_tree(u.group(1)):
                if segs[0] in aliases:
                    segs = ['crate'] + aliases[segs[0]].split('::') + segs[1:]
                elif segs[0] not in ('crate', '$crate', 'super', 'self'):
                    continue  # another crate, or a child module (`use gemm::X` in its parent)
                found.append((u.start(), segs, text))
                whole = '::'.join(resolved_segments(segs, scope_at(m, spans, u.start())))
                if bound and bound not in ('crate', 'super', 'self') and whole in mods:
                    aliases[bound] = whole
        inside_use = lambda pos: any(a <= pos < b for a, b in uses)
        for x in INLINE.finditer(code):
            if inside_use(x.start()):
                continue
            segs = [x.group(1)] + [s for s in re.split(r'\s*::\s*', x.group(2)) if s]
            found.append((x.start(), segs, x.group(0).strip()))
        if aliases:
            names = '|'.join(sorted(map(re.escape, aliases), key=len, reverse=True))
            for x in re.finditer(r'(?<![\w:$])(' + names + r')((?:\s*::\s*\w+)+)', code):
                if inside_use(x.start()):
                    continue
                rest = [s for s in re.split(r'\s*::\s*', x.group(2)) if s]
                found.append((x.start(), ['crate'] + aliases[x.group(1)].split('::') + rest, x.group(0).strip()))
        for pos, segs, text in sorted(found, key=lambda f: f[0]):
            r = resolve(segs, scope_at(m, spans, pos), mods)
            if r is None or r == m:
                continue
            if r not in edges[m]:
                edges[m][r] = (path, line_of(code, pos), text)
    return edges


def resolved_segments(segs, cur):
    if segs[0] in ('crate', '$crate'):
        return segs[1:]
    if segs[0] == 'super':
        base, parts = (cur.split('::') if cur else []), list(segs)
        while parts and parts[0] == 'super':
            base, parts = base[:-1], parts[1:]
        return base + parts
    if segs[0] == 'self':
        return (cur.split('::') if cur else []) + segs[1:]
    return segs


def is_ancestor(a, b):
    return a == '' or b.startswith(a + '::')


def cycles(edges):
    """Strongly connected components of more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def a_cycle(comp, edges):
    """One cycle through the first module of a component, as a module list."""
    start, inside = comp[0], set(comp)
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in inside and w not in prev:
                prev[w] = v
                queue.append(w)
    return comp + [comp[0]]


def allowed_table():
    """Folder -> (the folder's cell, [allowed targets]) from the doc's table."""
    with open(DOC, encoding='utf-8') as fh:
        lines = fh.read().splitlines()
    try:
        at = next(i for i, l in enumerate(lines) if l.startswith('#') and TABLE in l)
    except StopIteration:
        sys.exit(f'check_deps: {os.path.relpath(DOC, ROOT)} has no section "{TABLE}"')
    rows = []
    for l in lines[at + 1:]:
        if l.startswith('#'):
            break
        if l.startswith('|'):
            rows.append([c.strip() for c in l.strip().strip('|').split('|')])
        elif rows:
            break
    header, body = rows[0], [r for r in rows[2:]]
    try:
        col = [c.lower() for c in header].index(COLUMN)
    except ValueError:
        sys.exit(f'check_deps: the table "{TABLE}" of {os.path.relpath(DOC, ROOT)} has no column "{COLUMN}"')
    table = {}
    for r in body:
        cell = r[0].strip('`')
        m = re.fullmatch(r'src/(\w+)(?:/|\.rs)', cell)
        if not m:
            continue  # src/bin/strata/, testkit/: not the library
        deps = re.sub(r'\([^)]*\)', '', r[col])  # notes in parentheses
        targets = []
        for item in re.split(r'[,;]|\band\b', deps):
            item = item.strip().strip('`').strip()
            if item in ('', '—', '-'):
                continue
            targets.append(item)
        table[m.group(1)] = (r[col], targets)
    return table


def main():
    verbose = '-v' in sys.argv[1:]
    mods = modules()
    raw = graph(mods)
    # A module and its ancestors or descendants are one unit (declarations, re-exports, `super::`).
    edges = {m: {d: w for d, w in ds.items() if not is_ancestor(d, m) and not is_ancestor(m, d)} for m, ds in raw.items()}
    failures = []

    for comp in cycles({m: set(ds) for m, ds in edges.items()}):
        cyc = a_cycle(comp, edges)
        lines = [f'module cycle: {" -> ".join(cyc)}']
        for a, b in zip(cyc, cyc[1:]):
            f, ln, text = edges[a][b]
            lines.append(f'  {f}:{ln}: {a} imports {b}: {text}')
        failures.append('\n'.join(lines))

    table = allowed_table()
    folders = sorted({m.split('::')[0] for m in mods if m})
    doc = os.path.relpath(DOC, ROOT)
    for f in folders:
        if f not in table:
            failures.append(f'src/{f}: no row in the table "{TABLE}" of {doc}: say what it owns and what it depends on')
    for f, (_, targets) in sorted(table.items()):
        if f not in folders:
            failures.append(f'{doc}: the table "{TABLE}" has a row for src/{f}, which does not exist')
        for t in targets:
            if t.split('::')[0] not in folders:
                failures.append(f'{doc}: src/{f} "depends on" {t!r}, which is not a folder of src/')

    def allows(src, target_module):
        # `pipeline::source` allows that module and its children; `pipeline` all of it.
        return any(target_module == t or target_module.startswith(t + '::') for t in table.get(src, ('', []))[1])

    folder_edges = {}
    for m, ds in sorted(edges.items()):
        top = m.split('::')[0]
        for d, where in sorted(ds.items()):
            dtop = d.split('::')[0]
            if not m or not d or top == dtop:
                continue
            folder_edges.setdefault(top, {}).setdefault(dtop, []).append((m, d, where))
            if top in table and not allows(top, d):
                f, ln, text = where
                cell = table[top][0]
                failures.append(
                    f'{f}:{ln}: {m} imports {d}: {text}\n'
                    f'  {doc} ("{TABLE}") allows src/{top}/ to depend on: {cell}'
                )

    # The table lists the layers from the bottom up: a row names only rows before it (so no cycle either).
    seen = set()
    for f, (cell, targets) in table.items():
        for t in targets:
            top = t.split('::')[0]
            if top != f and top in table and top not in seen:
                failures.append(
                    f'{doc}: src/{f} depends on {t}, which the table "{TABLE}" lists after it '
                    f'(rows go from the bottom layer up: move the row, or drop the dependency)'
                )
        seen.add(f)

    if verbose:
        for f in sorted(folder_edges):
            print(f'  {f} -> {", ".join(sorted(folder_edges[f]))}')
        for f, (_, ts) in sorted(table.items()):
            unused = [t for t in ts if not any(d == t or d.startswith(t + '::') for ds in folder_edges.get(f, {}).values() for _, d, _ in ds)]
            if unused:
                print(f'  note: src/{f}/ may depend on {", ".join(unused)} but does not')

    if failures:
        print('check_deps: FAILED', file=sys.stderr)
        for x in failures:
            print(x, file=sys.stderr)
        print(f'(move the code so that each import points down the table, or change the table in {doc} and say why)', file=sys.stderr)
        return 1
    n = sum(len(v) for v in folder_edges.values())
    print(f'check_deps: {len(mods)} modules, no cycle; {n} folder edges, each allowed by {doc}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
