"""mkdocs hooks (mkdocs.yml: hooks).

- Sphinx roles in docstrings read as plain code: peerwatch's docstrings say
  :class:`Config` and ``value``; mkdocstrings renders the double backticks as code but
  leaves the role's name in front of it. Drop the name, and the second colon of a
  reStructuredText ``text::`` that introduces a code block.
- docs/performance.md is written from the benchmarks' results. Until it exists, the site
  gets a stand-in page saying so, so that links to it and the nav stay valid under
  ``--strict``; once the file is there, this hook does nothing.
"""

from __future__ import annotations

import re
from typing import Any

from mkdocs.structure.files import File, Files

_ROLE = re.compile(r":(?:class|func|meth|attr|exc|mod|data|obj):(<code>)")
_LITERAL_INTRO = re.compile(r"(?<=\S):(:</p>\s*<div class=\"highlight\">)")

_PERFORMANCE_STAND_IN = """# Performance

The benchmark figures have not been published in `docs/performance.md` yet.
Run them yourself with `./dev bench` (`benchmarks/run.py`: detection and teardown latency
beside Lightning's observer, torchrun's agent and no watcher; launcher death; idle CPU;
step-time overhead; startup), or `.venv/bin/python benchmarks/launchers.py` for each
launcher with and without peerwatch. The [comparison](comparison.md) quotes the figures
measured so far.
"""


def on_files(files: Files, config: Any) -> Files:
    if files.get_file_from_path("performance.md") is None:
        files.append(File.generated(config, "performance.md", content=_PERFORMANCE_STAND_IN))
    return files


def on_page_content(html: str, **kwargs: Any) -> str:
    return _LITERAL_INTRO.sub(r"\1", _ROLE.sub(r"\1", html))
