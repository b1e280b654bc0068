"""Which carried wheels to install without breaking what this Python already has (scripts/gpu-ci.sh serve).

    python3 scripts/pick_wheels.py WHEEL...           # prints the wheels to install, one a line; notes on stderr
    python3 scripts/pick_wheels.py --check WHEEL...   # after installing: does every package see the versions it
                                                      # requires of the carried names? (exit 1 if not)

A wheel is installed when its distribution is missing here, or when a wheel being installed refuses the version here;
a version that fits is kept, so the machine's own packages (its pydantic, anyio, httpx...) keep working as they did.
Replacing a package also replaces those of this machine that would refuse the new version (pydantic with its exact
pydantic-core), when they were carried too; otherwise it says which ones may break.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def applies(requirement: Requirement) -> bool:
    return requirement.marker is None or requirement.marker.evaluate({"extra": ""})


def wheel_requirements(path: str) -> list[Requirement]:
    """The requirements a wheel declares that apply here (markers evaluated, no extras)."""
    with zipfile.ZipFile(path) as wheel:
        metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = email.parser.Parser().parsestr(wheel.read(metadata).decode("utf-8"))
    return [r for r in map(Requirement, message.get_all("Requires-Dist") or []) if applies(r)]


def visible() -> dict[str, tuple[str, list[Requirement]]]:
    """Every distribution this Python imports (the first of a name on sys.path): its version and requirements."""
    found: dict[str, tuple[str, list[Requirement]]] = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name and name not in found:
            found[name] = (dist.version, [r for r in map(Requirement, dist.requires or []) if applies(r)])
    return found


def refusals(name: str, version: str, requirers: dict[str, list[Requirement]]) -> list[str]:
    return [f"{who} needs {r}" for who, requirements in requirers.items() for r in requirements
            if canonicalize_name(r.name) == name and not r.specifier.contains(version, prereleases=True)]


def pick(wheels: dict[str, str]) -> list[str]:
    here = visible()
    carried = {name: (parse_wheel_filename(Path(path).name)[1].public, wheel_requirements(path))
               for name, path in wheels.items()}
    chosen = {name for name in wheels if name not in here}
    while True:  # until no installed wheel refuses a kept version, and no kept package refuses an installed one
        grown = set(chosen)
        ours = {name: carried[name][1] for name in chosen}
        theirs = {name: requirements for name, (_, requirements) in here.items() if name not in chosen}
        for name in wheels.keys() - chosen:
            if refused := refusals(name, here[name][0], ours):
                print(f"pick_wheels: replacing {name} {here[name][0]} ({'; '.join(refused)})", file=sys.stderr)
                grown.add(name)
        for name in chosen & here.keys():
            for who in {w for w in theirs if refusals(name, carried[name][0], {w: theirs[w]})}:
                if who in wheels:
                    grown.add(who)
                else:
                    print(f"pick_wheels: WARNING {who} {here[who][0]} refuses {name} {carried[name][0]}",
                          file=sys.stderr)
        if grown == chosen:
            break
        chosen = grown
    for name in sorted(wheels.keys() - chosen):
        print(f"pick_wheels: keeping this machine's {name} {here[name][0]}", file=sys.stderr)
    return [wheels[name] for name in sorted(chosen)]


def check(names: set[str]) -> int:
    """Every visible package's requirements on ``names`` are met by the versions now visible."""
    here = visible()
    problems = [f"{who} needs {r}, sees {here.get(canonicalize_name(r.name), ('nothing',))[0]}"
                for who, (_, requirements) in here.items() for r in requirements
                if canonicalize_name(r.name) in names and (canonicalize_name(r.name) not in here or not
                                                           r.specifier.contains(here[canonicalize_name(r.name)][0],
                                                                                prereleases=True))]
    for problem in problems:
        print(f"pick_wheels: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    checking = argv[:1] == ["--check"]
    wheels = {canonicalize_name(parse_wheel_filename(Path(p).name)[0]): p for p in argv[checking:]}
    if checking:
        return check(set(wheels))
    for path in pick(wheels):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
