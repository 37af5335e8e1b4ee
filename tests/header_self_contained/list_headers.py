#!/usr/bin/env python3
"""Lists gradaccum's headers with the optional dependencies each one needs.

Prints one line per header, `<group> <include name>`, sorted: <group> is `core` for a header
that needs only the standard library, else the `+`-joined components whose third-party headers
it includes directly or through other gradaccum headers (e.g. `eigen`, `cereal+eigen`).

With --expect, instead checks that the listing still equals the one Meson configured with,
that no header includes a third-party header this script does not know, and that no header
outside backends/<name>/ needs a backend; exits 1 naming each problem.
"""
import argparse
import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)

# Third-party include prefixes and the component (Meson feature / CMake component) they need.
COMPONENT_OF_PREFIX = {
    "Eigen/": "eigen",
    "unsupported/Eigen/": "eigen",
    "xtensor/": "xtensor",
    "xtl/": "xtensor",
    "xsimd/": "xtensor",
    "cereal/": "cereal",
    "rapidjson/": "cereal",  # Debian's cereal uses the system rapidjson
    "xxhash.h": "cereal",  # checkpoint checksums (libxxhash, header-only)
    "mpi.h": "mpi",
    "mpi-ext.h": "mpi",  # Open MPI's extensions (its CUDA support query), where present
    "ATen/": "torch",
    "c10/": "torch",
    "torch/": "torch",
}
# Components that are tensor backends, each with its own folder under backends/.
BACKENDS = {"eigen", "xtensor", "torch"}
# Always available: POSIX headers (atomic checkpoint files), omp.h, which is included only
# under `#if defined(_OPENMP)` and so needs nothing when OpenMP is off, and immintrin.h, the
# compiler's own, included only under `#ifdef __F16C__`.
SYSTEM = {"fcntl.h", "unistd.h", "sys/stat.h", "sys/types.h", "omp.h", "immintrin.h"}


def include_roots(root):
    return [root / "include"] + sorted(root.glob("backends/*/include"))


def headers(root):
    """Maps include name (`gradaccum/...hpp`) to its file."""
    found = {}
    for base in include_roots(root):
        for path in sorted((base / "gradaccum").rglob("*.hpp")):
            found[path.relative_to(base).as_posix()] = path
    return found


def is_standard(name):
    # C++ standard headers have neither a directory nor an extension.
    return "/" not in name and "." not in name


def component_of(name):
    for prefix, component in COMPONENT_OF_PREFIX.items():
        if name == prefix or name.startswith(prefix):
            return component
    return None


def classify(all_headers):
    """Returns ({include name: components needed}, [(header, unknown include)],
    {include name: components of its own includes}, {include name: gradaccum headers it includes})."""
    direct, unknown, local = {}, [], {}
    for name, path in all_headers.items():
        components, includes = set(), []
        for included in INCLUDE.findall(path.read_text(encoding="utf-8")):
            if included in all_headers:
                includes.append(included)
            elif (component := component_of(included)) is not None:
                components.add(component)
            elif not is_standard(included) and included not in SYSTEM:
                unknown.append((name, included))
        direct[name], local[name] = components, includes

    needs = {}

    def closure(name, visiting=()):
        if name not in needs:
            components = set(direct[name])
            for included in local[name]:
                if included not in visiting:
                    components |= closure(included, visiting + (name,))
            needs[name] = components
        return needs[name]

    for name in all_headers:
        closure(name)
    return needs, unknown, direct, local


def backend_of(root, path):
    """The backend whose folder holds `path`, or None for the core."""
    relative = path.relative_to(root).parts
    return relative[1] if relative[0] == "backends" else None


def misplaced(root, all_headers, direct, local):
    """Headers that include a backend (its third-party headers or its gradaccum header) they do
    not belong to: the core must compile without any backend. Reported where the include is."""
    found = []
    for name, path in all_headers.items():
        included_backends = direct[name] | {backend_of(root, all_headers[other]) for other in local[name]}
        for backend in sorted(included_backends & BACKENDS - {backend_of(root, path)}):
            found.append(f"{path.relative_to(root)} includes the {backend} backend, but the core "
                         f"(and every other backend) must compile without it")
    return found


def cycles(local):
    """Include cycles among gradaccum's headers, each as the chain of headers that closes it: every
    include must point down a layer, so a header never reaches itself."""
    found, state = [], {}  # state: 1 while on the current path, 2 once finished

    def visit(name, path):
        state[name] = 1
        for included in local[name]:
            if state.get(included) == 1:
                found.append(path[path.index(included):] + [included])
            elif included not in state:
                visit(included, path + [included])
        state[name] = 2

    for name in sorted(local):
        if name not in state:
            visit(name, [name])
    return found


def listing(root):
    all_headers = headers(root)
    needs, unknown, direct, local = classify(all_headers)
    problems_of_cycles = [f"include cycle: {' -> '.join(chain)} (every include must point down a layer)"
                          for chain in cycles(local)]
    lines = sorted(f"{'+'.join(sorted(components)) or 'core'} {name}" for name, components in needs.items())
    problems = [f"{header} includes <{included}>, which is neither a standard header nor a known dependency "
                f"(add it to COMPONENT_OF_PREFIX in {pathlib.Path(__file__).name})" for header, included in unknown]
    return lines, problems + problems_of_cycles + misplaced(root, all_headers, direct, local)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=pathlib.Path, required=True, help="the gradaccum source tree")
    parser.add_argument("--expect", help="comma-separated listing Meson was configured with")
    args = parser.parse_args()
    lines, problems = listing(args.root.resolve())
    if args.expect is None:
        print("\n".join(lines))
        return 0
    if lines != args.expect.split(","):
        problems.append("the public headers changed since Meson was configured: run `meson setup --reconfigure` "
                        "so every header gets its self-contained test")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
