"""mkdocs hook (mkdocs.yml: hooks): Sphinx roles in docstrings read as plain code.

peerwatch's docstrings say :class:`Config` and ``value``; mkdocstrings renders the
double backticks as code but leaves the role's name in front of it. Drop the name.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|exc|mod|data|obj):(<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(r"\1", html)
