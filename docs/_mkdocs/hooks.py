"""mkdocs hooks: README.md is the site's home page, and links leaving docs/ keep working.

The pages link as they must on a repository browser: the README to ``docs/CLI.md``, a page
under docs/ to ``../README.md`` or ``../benchmarks/README.md``. In the site the README is
``index.md`` and docs/ is the root, so those links are rewritten before mkdocs checks them:
to the page they name where the site has it, else to the file in the repository (``repo_url``
in mkdocs.yml) or, with no ``repo_url``, to its path as text. Every other link is checked by
mkdocs as usual (``validation`` in mkdocs.yml: any broken one fails ``mkdocs build --strict``).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HOME = "index.md"


def on_files(files: Files, config: Any) -> Files:
    """Add the repository's README.md as the home page, ``index.md``."""
    readme = Path(config.config_file_path).parent / "README.md"
    files.append(File.generated(config, HOME, abs_src_path=str(readme)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite the page's links that leave docs/ (outside fenced code blocks)."""
    root = Path(config.config_file_path).parent
    docs = Path(config.docs_dir).resolve().relative_to(root.resolve()).as_posix()
    src = page.file.src_uri
    # Where the page lives in the repository: README.md at the root, the others under docs/.
    repo_path = "README.md" if src == HOME else f"{docs}/{src}"
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced:
            line = LINK.sub(lambda m: _link(m, repo_path, src, docs, config), line)
        out.append(line)
    return "\n".join(out)


def _link(match: re.Match[str], repo_path: str, src: str, docs: str, config: Any) -> str:
    text, target = match.group("text"), match.group("target")
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return match.group(0)  # a URL, an anchor on this page, an absolute path
    path, hash_, anchor = target.partition("#")
    in_repo = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path))
    if in_repo == "README.md":
        site_path = HOME
    elif in_repo.startswith(docs + "/"):
        site_path = in_repo[len(docs) + 1 :]
    else:
        return _outside(text, in_repo, hash_ + anchor, config)
    relative = posixpath.relpath(site_path, posixpath.dirname(src) or ".")
    return f"[{text}]({relative}{hash_}{anchor})"


def _outside(text: str, path: str, anchor: str, config: Any) -> str:
    """A link to a repository file that is no page of the site."""
    if config.repo_url:
        return f"[{text}]({config.repo_url.rstrip('/')}/blob/main/{path}{anchor})"
    if text.strip("`") == path:
        return f"`{path}`"
    return f"{text} (`{path}`)"
