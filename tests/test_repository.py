"""The repository speaks of the product: no development history in file names or text, one current result per op,
GPU and world size (each stating the commit and date it was measured on), a README a newcomer can read."""
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", "build", "dist", "bench-results",
             "gpu-batch-out", ".whl"}
TEXT = (".py", ".md", ".sh", ".toml", ".txt", ".json", ".cfg", ".yml", ".yaml")
WORD = "sess" + "ion"  # spelled in two so that this file does not match its own patterns
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|"
            "twentieth|[0-9]+(?:st|nd|rd|th)")
HISTORY = re.compile(rf"{WORD}[-_ ]?[0-9]+|\b(?:{ORDINALS})\s+{WORD}", re.IGNORECASE)
#: <op>-<gpu>x<W>, with -<N>hosts where the group spanned N (virtual) hosts (benchmarks/report.py)
RESULT_NAME = re.compile(r"^[a-z0-9_]+-[A-Za-z0-9_]+x[0-9]+(-[0-9]+hosts)?\.(json|md|png)$")


def _files():
    """The repository's files: what git tracks or would track (ignored files are not the repository's), or, outside
    a git checkout, every file but build and cache folders."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        yield from (f for f in out.splitlines() if os.path.isfile(os.path.join(ROOT, f)))
        return
    except (OSError, subprocess.CalledProcessError):
        pass
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            yield os.path.relpath(os.path.join(top, name), ROOT)


def test_no_development_history_in_names_or_text():
    bad = []
    for rel in _files():
        if HISTORY.search(rel) or "-rerun" in rel.lower():
            bad.append(f"{rel}: file name")
        if not rel.endswith(TEXT):
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if HISTORY.search(line):
                    bad.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not bad, "development history in the repository:\n" + "\n".join(bad[:20])


def test_results_are_one_current_set_per_op_gpu_and_world_size():
    folder = os.path.join(ROOT, "benchmarks", "results")
    names = sorted(os.listdir(folder))
    assert names, "no committed results"
    odd = [n for n in names if not RESULT_NAME.match(n)]
    assert not odd, f"benchmarks/results holds <op>-<gpu>x<W>[-<N>hosts].{{json,md,png}} only, not {odd}"
    for name in names:
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                doc = json.load(f)
            assert doc.get("commit") and re.match(r"^\d{4}-\d{2}-\d{2}$", doc.get("date", "")), \
                f"{name} must state the commit and date it was measured on"
            stem = name[:-len(".json")]
            hosts = re.search(r"-([0-9]+)hosts$", stem)
            op, rest = stem[:hosts.start() if hosts else None].rsplit("-", 1)
            assert doc["op"] == op and doc["world_size"] == int(rest.rsplit("x", 1)[1]), name
            assert all(r.get("num_hosts", 1) == (int(hosts.group(1)) if hosts else 1) for r in doc["records"]), name
            assert doc["records"], f"{name} has no records"


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the rest belongs in docs/"
