#!/usr/bin/env python3
"""The workspace's shape, checked: no import cycle between the modules of one crate, no
function in levee-gateway over 80 lines, and no two blocks of more than 10 lines in
levee-gateway that are the same or the same shape (names, strings and numbers aside).
Test code (`#[cfg(test)]` modules, `tests/`, `benches/`) is left out. Exits 1 on any
finding, printing each.

    python3 .ci/shape.py [workspace root]
"""

import os
import re
import sys
from collections import defaultdict

MAX_FN_LINES = 80
DUP_LINES = 11
GATEWAY = "levee-gateway"


def strip_code(text):
    """Comments and the contents of string and char literals blanked, newlines kept."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and not re.match(r"\w", text[i - 1] if i else " "):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append('"' + re.sub(r"[^\n]", " ", text[i + 1:j - 1]) + '"')
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('"' + re.sub(r"[^\n]", " ", text[i + 1:j]) + '"')
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or text.startswith("'\\u{", i):
            j = text.find("'", i + 1)
            out.append("' '" + " " * max(0, j - i - 2))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def drop_test_modules(code):
    """Blanks `#[cfg(test)]` items (their lines stay, empty)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", code)
        if not m:
            return code
        end = matching_brace(code, m.end() - 1)
        code = code[:m.start()] + re.sub(r"[^\n]", " ", code[m.start():end + 1]) + code[end + 1:]


def sources(crate_dir):
    src = os.path.join(crate_dir, "src")
    for dirpath, _, files in os.walk(src):
        for f in sorted(files):
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    yield path, os.path.relpath(path, src), drop_test_modules(strip_code(fh.read()))


def top_module(rel):
    parts = rel[:-3].split(os.sep)
    return None if parts[0] in ("lib", "main") else parts[0]


def crate_refs(code):
    """Top-level modules of this crate that `code` names through `crate::`."""
    refs = set(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", code))
    for group in re.findall(r"\bcrate::\{([^}]*)\}", code):
        refs.update(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
    return refs


def cycles(graph):
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def long_functions(path, code):
    lines = code.count("\n")
    for m in re.finditer(r"\bfn\s+([A-Za-z_]\w*)", code):
        # The body starts at the first `{` after the signature (a `;` first: no body).
        rest = code[m.end():]
        brace, semi = rest.find("{"), rest.find(";")
        if brace < 0 or (0 <= semi < brace):
            continue
        start = code.count("\n", 0, m.start()) + 1
        end = code.count("\n", 0, matching_brace(code, m.end() + brace)) + 1
        if end - start + 1 > MAX_FN_LINES and end <= lines + 1:
            yield f"{path}:{start}: fn {m.group(1)} is {end - start + 1} lines (at most {MAX_FN_LINES})"


KEYWORDS = set(
    "as async await break const continue crate dyn else enum extern false fn for if impl in let "
    "loop match mod move mut pub ref return self Self static struct super trait true type unsafe "
    "use where while Some None Ok Err".split()
)


def shape(line):
    line = re.sub(r'"[^"]*"', "S", line)
    line = re.sub(r"\b\d[\d_]*(\.\d+)?([eE][+-]?\d+)?\w*\b", "N", line)
    line = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: m.group(0) if m.group(0) in KEYWORDS else "I", line)
    return re.sub(r"\s+", "", line)


def duplicate_blocks(files):
    """Runs of DUP_LINES meaningful lines that stand twice, alike but for names and values."""
    windows = defaultdict(list)
    for path, code in files:
        kept = []
        for no, line in enumerate(code.split("\n"), 1):
            s = shape(line)
            # Lines of punctuation alone (closing braces, `} else {`) and attributes
            # (`#[derive(..)]` on every type) say nothing.
            if s.startswith("#") or not re.search(r"[A-Za-z]", s.replace("else", "")):
                continue
            # Declarations and data are not logic: a field of a type (`pub name: Type,`), of
            # a literal (`name: 5,`) or an enum's variant (`Name,`) is the same shape in
            # every type.
            if re.fullmatch(r"(pub(\([^)]*\))?)?I:[^=]*,|I(\(.*\))?,", s):
                continue
            kept.append((no, s))
        for i in range(len(kept) - DUP_LINES + 1):
            run = kept[i:i + DUP_LINES]
            # A list of one line shape (enum variants, struct fields) is a list, not logic.
            if len({s for _, s in run}) < 5:
                continue
            windows["\n".join(s for _, s in run)].append((path, run[0][0], run[-1][0]))
    seen = set()
    for places in windows.values():
        if len(places) < 2:
            continue
        first = places[0]
        for other in places[1:]:
            if other[0] == first[0] and other[1] <= first[2]:
                continue  # overlapping windows of one run
            key = (first[0], other[0])
            if key in seen:
                continue
            seen.add(key)
            yield f"{first[0]}:{first[1]}-{first[2]} ~ {other[0]}:{other[1]}-{other[2]}: same shape"


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    crates_dir = os.path.join(root, "crates")
    problems = []
    gateway_files = []
    for crate in sorted(os.listdir(crates_dir)):
        crate_dir = os.path.join(crates_dir, crate)
        if not os.path.isdir(os.path.join(crate_dir, "src")):
            continue
        graph = defaultdict(set)
        for path, rel, code in sources(crate_dir):
            module = top_module(rel)
            shown = os.path.relpath(path, root)
            if module is not None:
                graph[module].update(r for r in crate_refs(code) if r != module)
            if crate == GATEWAY:
                problems.extend(long_functions(shown, code))
                gateway_files.append((shown, code))
        for comp in cycles(graph):
            problems.append(f"crates/{crate}: import cycle between modules {', '.join(comp)}")
    problems.extend(duplicate_blocks(gateway_files))
    for p in problems:
        print(p)
    if problems:
        print(f"shape: {len(problems)} problem(s)")
        return 1
    print("shape: no import cycle, no long function, no duplicate block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
