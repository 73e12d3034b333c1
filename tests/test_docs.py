"""README.md and docs/: the generated tables agree with the code, every relative link and anchor
resolves, and the README stays a front page."""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(path: str) -> set[str]:
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)  # a '#' in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_generated_tables_agree_with_the_code():
    """The recipe layouts, the planner's step times and the config defaults in the docs are what
    tools/docs_tables.py computes now: a change to a recipe or the planner fails here until the
    docs are regenerated."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "docs_tables.py"), "--check"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "<!-- generated: recipes (tools/docs_tables.py) -->\n| recipe |" in readme


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            where = f"{os.path.relpath(path, ROOT)}: ({target})"
            if not os.path.exists(dest):
                broken.append(f"{where} -> no file {os.path.relpath(dest, ROOT)}")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{where} -> no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page_with_the_commands_on_its_first_screen():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= 250
    first_screen = "\n".join(lines[:50])
    for command in ("bash tools/env/run_main.sh", "bash tools/env/run_tests.sh", "sbatch", "(docs/cluster.md)"):
        assert command in first_screen, command
    for page in glob.glob(os.path.join(ROOT, "docs", "*.md")):  # every page reachable from the map
        assert f"(docs/{os.path.basename(page)})" in "\n".join(lines), page


def test_the_ci_command_is_the_readmes():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "bash tools/env/run_tests.sh" in readme
    assert "exec bash tools/env/run_tests.sh" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_the_docs_teach_todays_option_spellings():
    """Old spellings still work (tests/test_cli.py keeps one test for the aliases), but no doc, and
    no row of the troubleshooting table generated from tests/test_bad_input.py, teaches them
    (newcomer review, F10)."""
    old = re.compile(r"(--output-dir|--hf |--ckpt |--out |--source auto)")
    taught = [f"{os.path.relpath(p, ROOT)}:{n}: {line.strip()[:100]}" for p in DOCS
              for n, line in enumerate(open(p), 1) if old.search(line) and "--out {" not in line]
    assert taught == []


def test_nothing_a_user_reads_cites_a_file_a_clone_lacks():
    """The package, its tools and the docs cited notes outside the repository (`../shared/notes/...`,
    newcomer review F14.5); a clone has none of them. The history page quotes what was."""
    roots = ["spice_megatron", "recipes", "tools", "slurm"]
    files = [p for p in DOCS if not p.endswith("history.md")] + [
        os.path.join(d, f) for r in roots for d, _, fs in os.walk(os.path.join(ROOT, r)) for f in fs
        if f.endswith((".py", ".sh", ".sbatch", ".md", ".txt"))]
    cited = [f"{os.path.relpath(p, ROOT)}:{n}" for p in files
             for n, line in enumerate(open(p, encoding="utf-8", errors="replace"), 1) if "shared/notes" in line]
    assert cited == []
